"""Benchmark: the disk tier's read rate and stalls, its reads overlapped with compute (issue 53).

    python benchmarks/disk_tier_overlap.py --build-layers 4 --work-dir DIR --memory-budget 40% \\
        --tokens 48 --rounds 4 --out FILE
    python benchmarks/disk_tier_overlap.py --model CONVERTED_DIR ...

One int8-converted model (built here: a random OLMoE-1B-7B checkpoint cut to --build-layers
layers, experts of the real size, converted and deleted at the end; or --model), one prompt
(the first --prompt-tokens tokens of held-out text) and greedy decoding of --tokens tokens
through the disk tier (`moespec.offload.engine.disk`) with the --policy, every position's
experts forced to a synthetic trace of real locality (larger_than_memory.py's replay). Arms
are settings of the same code, in one process:

    before       the tier as it was: a layer waits for all its reads, then computes
                 (on_arrival off; each expert's runs one pread each, one expert per thread),
                 each read checked by zlib.crc32 as it was (the tier's checksum swapped back)
    no-overlap   before, with the tier's own check (`expert_checksum`)
    after        the tier's defaults: the cached experts computed (on one thread) while the
                 misses are read, the misses once in
    chunks       after, and each expert's runs read in 1 MiB chunks, 8 in flight (an option)

Every round measures the disk's direct-I/O random-read bandwidth first (larger_than_memory's
probe: 1 MiB O_DIRECT preads, 1 and 4 in flight) and then runs every arm once, in an order
turned by one place each round. Per run: decode tokens/s, bytes read and stall per token, the
read rate during decode (bytes read / decode seconds) and its share of that round's probe;
paired ratios of each arm over `before`, round by round. The in-memory run of the same replay
runs last (its tokens are every run's reference; its peak RSS is not the disk arms', which is
read before it, and only for a --model given: a build in this process leaves its heap resident).
"""

import argparse
import json
import shutil
import sys
import time
import zlib
from pathlib import Path

import numpy as np

from moespec.offload.engine import disk

sys.path.insert(0, str(Path(__file__).resolve().parent))

from larger_than_memory import (  # noqa: E402
    RSS_ALLOWANCE,
    direct_read_bandwidth,
    parse_budget,
    peak_rss,
    replay_trace,
)

ARMS = {
    "before": dict(on_arrival=False),
    "no-overlap": dict(on_arrival=False),  # before with the tier's checksum
    "after": {},  # the defaults
    "chunks": dict(read_depth=8, chunk_bytes=1 << 20),
}
PROBES = ((1 << 20, 1), (1 << 20, 4))
CHECKSUM = disk.expert_checksum
RSS_NOTE = (
    "no peak RSS: this process built and converted the model (its heap stays resident); "
    "larger_than_memory.py measures it per arm in a process of its own"
)


def use_checksum(function) -> None:
    disk.expert_checksum = function


def decode(model, prompt, ids, *, policy, budget, tokens, arm=None):
    """One greedy generation of the replay: through the disk tier with `arm`'s settings
    (its figures beside), or in memory (arm None)."""
    from moespec.decoding import KernelPolicy, generate, summarize
    from moespec.offload import make_policy
    from moespec.offload.engine.disk import DiskStore
    from moespec.offload.engine.executor import OffloadEngine
    from moespec.offload.engine.replay import RoutingReplay

    layers = sorted(model.moe_blocks)
    engine = None
    if arm is None:
        executor = RoutingReplay(ids, layers, experts=model)
    else:
        if arm == "before":  # the check the tier took before `expert_checksum`
            use_checksum(lambda data: zlib.crc32(data))
        store = DiskStore.for_model(model, **ARMS[arm])
        engine = OffloadEngine.for_model(model, make_policy(policy), budget, store=store)
        executor = RoutingReplay(ids, layers, engine)
    try:
        stream = generate(
            model, prompt, max_tokens=tokens, kernels=KernelPolicy("slot"), offload=executor
        )
        records = [next(stream)]  # the prefill (the prompt on the CPU tier when offloaded)
        if engine is not None:
            engine.start()  # fitted on the prompt's routing; the policy's preload read
            before = engine.summary()
        records += list(stream)
        after = engine.summary() if engine is not None else None
    finally:
        if engine is not None:
            engine.close()
        use_checksum(CHECKSUM)
    s = summarize(records)
    result = {
        "tokens": [t for r in records for t in r.tokens],
        "decode_tokens": s["generated_tokens"] - 1,
        "decode_seconds": s["decode_seconds"],
        "tokens_per_second": s["tokens_per_second"],
    }
    if engine is not None:
        n = max(result["decode_tokens"], 1)
        delta = {
            k: after[k] - before[k]
            for k in ("disk_bytes_read", "read_seconds", "stall_seconds", "hits", "misses")
        }
        result.update(
            hit_rate=delta["hits"] / max(delta["hits"] + delta["misses"], 1),
            bytes_read_per_token=delta["disk_bytes_read"] / n,
            stall_seconds_per_token=delta["stall_seconds"] / n,
            read_seconds_per_token=delta["read_seconds"] / n,
            disk_read_rate=delta["disk_bytes_read"] / result["decode_seconds"],
            o_direct=after["o_direct"],
            slots=after["slots"],
        )
    return result


def paired(runs: dict, mine: str, theirs: str, key: str) -> dict:
    """runs[mine][key] / runs[theirs][key] round by round: median, low, high."""
    ratios = [a[key] / b[key] for a, b in zip(runs[mine], runs[theirs], strict=True)]
    return {"median": float(np.median(ratios)), "low": min(ratios), "high": max(ratios),
            "rounds": ratios}  # fmt: skip


def prepare(args) -> tuple[Path, list[Path]]:
    """(converted directory, what was made here to delete unless --keep)."""
    if args.model is not None:
        return args.model, []
    from moespec.bench.checkpoints import streamed_random_checkpoint
    from moespec.models.converted import convert, is_converted

    args.work_dir.mkdir(parents=True, exist_ok=True)
    source = streamed_random_checkpoint("olmoe-1b-7b", args.work_dir, args.build_layers)
    converted = args.work_dir / f"{source.name}-int8"
    made = [source]
    if not is_converted(converted):
        convert(source, converted, weights="int8", force=converted.exists())
        made.append(converted)
    shutil.rmtree(source, ignore_errors=True)
    return converted, made


def run(args) -> dict:
    import torch

    from moespec.calibrate.plan import verify_documents
    from moespec.models import load_model
    from moespec.offload.engine.disk import CHUNK_BYTES, READ_DEPTH, DiskLayout
    from moespec.provenance import provenance

    torch.set_num_threads(args.threads)
    directory, made = prepare(args)
    try:
        model, tokenizer = load_model(directory, pack_experts=False)
        model.native = False  # the eager pass, as larger_than_memory.py runs it
        model.batch_invariant = True  # as `moespec generate` decodes
        layout = DiskLayout(model)
        budget = parse_budget(args.memory_budget, layout.all_expert_bytes)
        text = "".join(d.text for d in verify_documents())
        prompt = tokenizer.encode(text)[: args.prompt_tokens]
        facts = {"num_experts": layout.num_experts, "top_k": layout.top_k,
                 "layer_indices": layout.layer_indices}  # fmt: skip
        ids, routing = replay_trace(facts, len(prompt) + args.tokens + 2, None, None, args.seed)
        options = dict(policy=args.policy, budget=budget, tokens=args.tokens)
        weights = layout.path
        runs, probes = {arm: [] for arm in args.arms}, []
        for round_ in range(args.rounds):
            probe = [direct_read_bandwidth(weights, b, d, args.probe_seconds) for b, d in PROBES]
            probes.append(probe)
            best = max(p.get("bytes_per_second", 0) for p in probe)
            turn = round_ % len(args.arms)
            for arm in args.arms[turn:] + args.arms[:turn]:
                result = decode(model, prompt, ids, arm=arm, **options)
                result.update(round=round_, probe_bytes_per_second=best,
                              read_rate_share_of_probe=result["disk_read_rate"] / best)  # fmt: skip
                runs[arm].append(result)
                print(
                    f"round {round_} {arm:>10}: {result['tokens_per_second']:.2f} tok/s, "
                    f"stall {1e3 * result['stall_seconds_per_token']:.1f} ms/tok, "
                    f"{result['disk_read_rate'] / 1e9:.2f} GB/s = "
                    f"{result['read_rate_share_of_probe']:.2f} of the probe ({best / 1e9:.2f})",
                    file=sys.stderr,
                )
        disk_peak_rss = peak_rss()
        reference = decode(model, prompt, ids, **options)
    finally:
        if not args.keep:
            for path in made:
                shutil.rmtree(path, ignore_errors=True)
    arms = {}
    for arm, arm_runs in runs.items():

        def median(key, arm_runs=arm_runs):
            return float(np.median([r[key] for r in arm_runs]))

        keys = ("tokens_per_second", "stall_seconds_per_token", "disk_read_rate",
                "read_rate_share_of_probe", "bytes_read_per_token", "hit_rate")  # fmt: skip
        arms[arm] = {
            **{f"median_{k}": median(k) for k in keys},
            "tokens_equal_in_memory": all(r["tokens"] == reference["tokens"] for r in arm_runs),
            "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in arm_runs],
        }
        if arm != "before" and "before" in runs:
            arms[arm]["over_before"] = {
                k: paired(runs, arm, "before", k)
                for k in ("tokens_per_second", "stall_seconds_per_token", "disk_read_rate")
            }
    bound = budget + layout.dense_bytes + RSS_ALLOWANCE
    rss = {"peak_rss_bytes": disk_peak_rss, "rss_bound_bytes": bound,
           "rss_within_bound": disk_peak_rss <= bound}  # fmt: skip
    if made:  # the build's heap stays resident in this process
        rss = {"rss_note": RSS_NOTE}
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    settings.update(model=None if args.model is None else directory.name, work_dir=None)
    return {
        "benchmark": "disk tier: reads overlapped with compute (issue 53)",
        "settings": settings,
        "arms_settings": {
            arm: {
                "on_arrival": True,
                "read_depth": READ_DEPTH,
                "chunk_bytes": CHUNK_BYTES,
                **ARMS[arm],
            }
            for arm in args.arms
        },  # fmt: skip
        "model": {
            "shape": "olmoe-1b-7b" if args.model is None else None,
            "layers": layout.num_layers,
            "num_experts": layout.num_experts,
            "top_k": layout.top_k,
            "expert_slot_bytes": layout.stride,
            "weights_bytes": layout.file_size,
            "dense_bytes": layout.dense_bytes,
            "all_expert_bytes": layout.all_expert_bytes,
        },  # fmt: skip
        "budget_bytes": budget,
        "routing": routing,
        "direct_read_bandwidth": probes,
        "in_memory": {k: v for k, v in reference.items() if k != "tokens"},
        "in_memory_note": "the in-memory run reads the experts' mapped pages as they are in the "
        "page cache (warm or cold after the direct reads): not a compute bound",
        "arms": arms,
        **rss,
        "provenance": provenance(settings={"threads": args.threads}),
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a converted (int8) model directory")
    parser.add_argument("--build-layers", type=int, default=4)
    parser.add_argument("--work-dir", type=Path, default=Path("benchmarks/checkpoints/dto"))
    parser.add_argument("--keep", action="store_true", help="keep the converted model built")
    parser.add_argument("--policy", default="lru")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--memory-budget", default="40%")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--probe-seconds", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    args.arms = args.arms.split(",")
    if unknown := [a for a in args.arms if a not in ARMS]:
        parser.error(f"unknown arms {unknown} (known: {', '.join(ARMS)})")
    if args.out is not None and args.out.exists() and not args.force:
        parser.error(f"{args.out} exists: pass --force to overwrite it")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    result = run(args)
    result["seconds"] = time.perf_counter() - start
    for arm, row in result["arms"].items():
        ratio = row.get("over_before", {}).get("tokens_per_second")
        print(
            f"{arm:>10}: {row['median_tokens_per_second']:.2f} tok/s, stall "
            f"{1e3 * row['median_stall_seconds_per_token']:.1f} ms/tok, read rate "
            f"{row['median_read_rate_share_of_probe']:.2f} of the probe, same tokens "
            f"{row['tokens_equal_in_memory']}"
            + (
                ""
                if ratio is None
                else f", {ratio['median']:.2f}x before ({ratio['low']:.2f}-{ratio['high']:.2f})"
            )  # fmt: skip
        )
    print(f"in memory: {result['in_memory']['tokens_per_second']:.2f} tok/s")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
