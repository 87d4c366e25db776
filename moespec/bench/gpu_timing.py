"""The CUDA side of the GPU expert-kernel benchmark: the kernels timed, the timer, the tuner.

Kernels (all on the signature f(x, expert_ids, expert_weights)): the Triton per-slot and
deduplicating kernels, a loop of F.linear over the distinct experts (grouped on the host before
timing), torch's grouped GEMM (`F.grouped_mm`) and transformers' experts module on its
"grouped_mm" path. Used by benchmarks/gpu_expert_kernels.py.
"""

import statistics
import sys

import numpy as np
import torch
import torch.nn.functional as F

from moespec.bench.gpu_passes import CHOSEN, chosen_ids, distinct_count, requested_bytes
from moespec.calibrate.bench import random_experts
from moespec.kernels import ExpertWeights, reference_experts

TRITON_KERNELS = ("slot", "dedup")
ERROR_LIMIT = 2e-2  # relative L2 error against the fp32 reference that fails a check


def grouped_mm_experts(x, expert_ids, expert_weights, experts: ExpertWeights):
    """torch's grouped GEMM: slots sorted by expert on the device, two grouped products."""
    tokens, top_k = expert_ids.shape
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # [S] slots grouped by expert
    counts = torch.zeros(experts.num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)  # [E] end of each expert's rows
    rows = order // top_k
    hidden = F.grouped_mm(x[rows], experts.gate_up.transpose(1, 2), offs=offsets)  # [S, 2I]
    inter = experts.intermediate_size
    act = F.silu(hidden[:, :inter]) * hidden[:, inter:]  # [S, I]
    out = F.grouped_mm(act, experts.down.transpose(1, 2), offs=offsets)  # [S, H]
    out = out.float() * expert_weights.reshape(-1)[order].unsqueeze(1)
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, rows, out)
    return y.to(x.dtype)


def transformers_experts(experts: ExpertWeights, top_k: int):
    """transformers' experts module on its "grouped_mm" path, holding these weights."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(
        hidden_size=experts.hidden_size,
        num_experts=experts.num_experts,
        moe_intermediate_size=experts.intermediate_size,
        num_experts_per_tok=top_k,
        hidden_act="silu",
    )
    config._experts_implementation = "grouped_mm"
    with torch.device("meta"):
        module = Qwen3MoeExperts(config)
    module.gate_up_proj = torch.nn.Parameter(experts.gate_up, requires_grad=False)
    module.down_proj = torch.nn.Parameter(experts.down, requires_grad=False)
    return lambda x, ids, weights: module(x, ids, weights)


def linear_loop(expert_ids, experts: ExpertWeights):
    """A loop of F.linear over the distinct experts; the grouping is done on the host before."""
    flat = expert_ids.reshape(-1).tolist()
    top_k = expert_ids.shape[1]
    groups = {}
    for slot, e in enumerate(flat):
        groups.setdefault(e, []).append(slot)
    device = experts.gate_up.device
    plan = [(e, torch.tensor(s, device=device)) for e, s in groups.items()]
    inter = experts.intermediate_size

    def run(x, ids, weights):
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        flat_weights = weights.reshape(-1)
        for e, slots in plan:
            rows = slots // top_k
            hidden = F.linear(x[rows], experts.gate_up[e])  # [r, 2I]
            out = F.linear(F.silu(hidden[:, :inter]) * hidden[:, inter:], experts.down[e])
            y.index_add_(0, rows, out.float() * flat_weights[slots].unsqueeze(1))
        return y.to(x.dtype)

    return run


def kernel_runner(name: str, experts, top_k, settings, expert_ids):
    """f(x, ids, weights) for one kernel; expert_ids are needed only by the host-grouped loop."""
    from moespec.kernels.triton import launch

    if name == "slot":
        return lambda x, ids, w: launch.slot_experts_triton(x, ids, w, experts, settings["slot"])
    if name == "dedup":
        return lambda x, ids, w: launch.dedup_experts_triton(x, ids, w, experts, settings["dedup"])
    if name == "linear-loop":
        return linear_loop(expert_ids, experts)
    if name == "grouped_mm":
        if not hasattr(F, "grouped_mm"):
            raise NotImplementedError("torch.nn.functional.grouped_mm is not in this torch")
        return lambda x, ids, w: grouped_mm_experts(x, ids, w, experts)
    return transformers_experts(experts, top_k)


# ---- timing (CUDA) ---------------------------------------------------------------------------


class Timer:
    """CUDA-event times in microseconds, each run after writing a buffer larger than the L2:
    the calibration's timer (`moespec.calibrate.timing.time_runs` on a CUDA device)."""

    def __init__(self, device: torch.device):
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 2**26
        self.device = device
        self.flush_bytes = max(4 * l2, 2**28)
        self.flush = torch.empty(self.flush_bytes // 4, dtype=torch.float32, device=device)

    def __call__(self, run, repeats: int) -> list[float]:
        from moespec.calibrate.timing import time_runs

        seconds = time_runs(
            run, repeats=repeats, warmup=0, flush=self.flush.zero_, device=self.device
        )
        return [s * 1e6 for s in seconds]


def replayable(fn, eager: bool):
    """(run, graphed): fn captured in a CUDA graph, so the host's launch overhead is not timed,
    or fn itself."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile, allocate
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    if eager:
        return fn, False
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as error:  # a kernel that synchronises with the host: time it eagerly
        print(f"  (not capturable, timed eagerly: {str(error).splitlines()[0]})", file=sys.stderr)
        torch.cuda.synchronize()
        return fn, False
    return graph.replay, True


def copy_bandwidth(timer: Timer, device, nbytes: int = 2**31, repeats: int = 20) -> dict:
    """The card's device-to-device copy bandwidth: bytes read plus written over the time."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1)
    dst = torch.empty_like(src)
    times = timer(lambda: dst.copy_(src), repeats)
    return {
        "bytes": 2 * nbytes,
        "times_us": times,
        "bytes_per_s": 2 * nbytes / (statistics.median(times) * 1e-6),
    }


def pass_inputs(expert_ids: np.ndarray, hidden: int, device, seed: int):
    generator = torch.Generator(device=device).manual_seed(seed)
    n, top_k = expert_ids.shape
    x = torch.randn(n, hidden, generator=generator, device=device, dtype=torch.bfloat16)
    weights = torch.softmax(torch.randn(n, top_k, generator=generator, device=device), -1)
    return x, torch.as_tensor(expert_ids, dtype=torch.long, device=device), weights


def check_kernels(runners: dict, experts: ExpertWeights, passes, device, seed):
    """(checks, failed): every kernel's relative L2 error against the fp32 reference on a few
    passes, and the kernels that could not run at all on this machine (with why)."""
    checks, failed = [], {}
    for p in passes:
        x, ids, weights = pass_inputs(p["expert_ids"], experts.hidden_size, device, seed)
        used, local = torch.unique(ids, return_inverse=True)  # only the experts the pass names
        fp32 = ExpertWeights(experts.gate_up[used].float(), experts.down[used].float())
        expected = reference_experts(x.float(), local, weights, fp32)
        for name, runner in runners.items():
            if name in failed:
                continue
            try:
                got = runner(p["expert_ids"])(x, ids, weights).float()
            except Exception as error:  # e.g. no grouped GEMM for this card: time the others
                failed[name] = str(error).splitlines()[0]
                print(f"  {name} cannot run here: {failed[name]}", file=sys.stderr)
                continue
            error = ((got - expected).norm() / expected.norm()).item()
            ok = error <= ERROR_LIMIT
            checks.append({"n": p["n"], "ids": p["ids"], "kernel": name, "error": error, "ok": ok})
            if not ok:
                print(
                    f"  CHECK FAILED: {name} n={p['n']} relative error {error:.3g}", file=sys.stderr
                )
    return checks, failed


def time_shape(args, shape, timer, settings, passes, device) -> tuple[list, list, dict]:
    """(timing records, checks, unavailable kernels) of every pass of one shape."""
    experts = random_experts(shape, torch.bfloat16, args.seed, device=device, pack=False)
    expert_bytes = experts.bytes_per_expert
    runners = {
        name: lambda ids, name=name: kernel_runner(name, experts, shape.top_k, settings, ids)
        for name in args.kernels
    }
    checked = [p for p in passes if p["ids"] == "most" and p["n"] in (2, max(args.tokens))]
    checks, unavailable = check_kernels(runners, experts, checked, device, args.seed)
    runners = {name: runner for name, runner in runners.items() if name not in unavailable}
    records, replays, inputs = [], {}, {}
    for p in passes:
        n, ids_array = p["n"], p["expert_ids"]
        if n not in inputs:
            inputs[n] = pass_inputs(ids_array, shape.hidden_size, device, args.seed)
        x, ids, weights = inputs[n]
        ids.copy_(torch.as_tensor(ids_array))  # graphs read the ids from this buffer
        distinct = distinct_count(ids_array)
        for name, runner in runners.items():
            key = (name, n) if name != "linear-loop" else None  # the loop bakes its grouping in
            if key not in replays:
                fn = runner(ids_array)
                replays[key] = replayable(
                    lambda fn=fn, x=x, ids=ids, w=weights: fn(x, ids, w), args.eager
                )
            run, graphed = replays.pop(None) if key is None else replays[key]
            repeats = args.repeats if p["ids"] != "trace" else args.window_repeats
            records.append(
                {
                    "shape": shape.name,
                    "ids": p["ids"],
                    "n": n,
                    "window": p["window"],
                    "kernel": name,
                    "expert_ids": ids_array.tolist(),
                    "distinct": distinct,
                    "slots": n * shape.top_k,
                    "expert_bytes": expert_bytes,
                    "graph": graphed,
                    "bytes": requested_bytes(name, n, shape.top_k, distinct, expert_bytes),
                    "times_us": timer(run, repeats),
                }
            )
    return records, checks, unavailable


# Launch settings swept per stage, gate_up first, then down with the best gate_up (see
# moespec/kernels/triton/settings.py for their meaning). Unlisted fields keep their defaults.
TUNE_CANDIDATES = {
    "slot": {
        "gate_up": [{"block_n": bn, "block_k": bk} for bn in (4, 8, 16) for bk in (256, 512, 1024)],
        "down": [
            {"block_n": bn, "block_k": bk, "split": split}
            for bn in (4, 8)
            for bk in (256, 512)
            for split in (1, 2)
        ],
    },
    "dedup": {
        "gate_up": [
            {"block_n": bn, "block_k": bk, "split": split}
            for bn, bk in ((16, 128), (16, 256), (32, 128))
            for split in (4, 8, 16)
        ],
        "down": [
            {"block_n": bn, "block_k": bk, "split": split}
            for bn, bk in ((16, 128), (16, 256), (16, 512), (32, 256))
            for split in (1, 2, 4, 8)
        ],
    },
}
TUNE_TOKENS = {"slot": (1, 2, 9), "dedup": (2, 9)}


def _score(kernel, stages, experts, passes, timer, device, args) -> float:
    """Summed median time (us) of a kernel with these stage settings over the passes."""
    from moespec.kernels.triton.settings import KernelSettings, StageSettings

    settings = {kernel: KernelSettings(**{s: StageSettings(**v) for s, v in stages.items()})}
    total = 0.0
    for p in passes:
        x, ids, weights = pass_inputs(p["expert_ids"], experts.hidden_size, device, args.seed)
        fn = kernel_runner(kernel, experts, ids.shape[1], settings, None)
        run, _ = replayable(lambda fn=fn, x=x, ids=ids, w=weights: fn(x, ids, w), args.eager)
        total += statistics.median(timer(run, args.repeats))
    return total


def tune_shape(shape, timer, device, args) -> tuple[dict, list]:
    """Best stage settings of both Triton kernels for one shape, and every score."""
    from moespec.kernels.triton.settings import TUNED

    experts = random_experts(shape, torch.bfloat16, args.seed, device=device, pack=False)
    rng = np.random.default_rng(args.seed)
    best, scores = {}, []
    for kernel in TRITON_KERNELS:
        passes = [
            {"n": n, "expert_ids": chosen_ids(kind, n, shape.top_k, shape.num_experts, rng)}
            for n in TUNE_TOKENS[kernel]
            for kind in CHOSEN
        ]
        stages = {s: dict(v) for s, v in TUNED["default"][kernel].items()}
        for stage, candidates in TUNE_CANDIDATES[kernel].items():
            trials = []
            for candidate in candidates:
                trial = {**stages, stage: {**stages[stage], **candidate}}
                try:
                    time_us = _score(kernel, trial, experts, passes, timer, device, args)
                except Exception as error:  # e.g. a tile too big for shared memory
                    scores.append(
                        {
                            "kernel": kernel,
                            "stage": stage,
                            **candidate,
                            "error": str(error).splitlines()[0],
                        }
                    )
                    continue
                trials.append((time_us, candidate))
                scores.append({"kernel": kernel, "stage": stage, **candidate, "time_us": time_us})
            if trials:  # else every candidate failed: keep the default
                stages[stage].update(min(trials, key=lambda t: t[0])[1])
        best[kernel] = stages
    return best, scores
