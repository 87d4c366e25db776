"""The disk tier in the simulator's terms: a profile fitted from measurements, and the measured
runs of `benchmarks/larger_than_memory.py` set up so that the simulator replays them exactly.

The engine (`moespec.offload.engine.disk`) as the timing model sees it, one CPU for everything:

    link         expert reads from the converted file into RAM slots, `io_threads` in flight
                 (O_DIRECT preadv of each expert's page-aligned runs, then a checksum of its
                 bytes: crc32 before the engine computed on arrival, its page-weighted word
                 sum `expert_checksum` since): a sequential link of the aggregate bandwidth B
                 and a latency per read lambda, both from the direct-read probe at the
                 engine's depth (two block sizes: per read b / B_probe(b) = lambda + b / B);
                 an expert costs `reads_per_expert` latencies. Its checksum's CPU time over
                 the copy's is `link_cpu_share`
    accelerator  the RAM slots, computed by the engine's kernel on this CPU: the per-slot kernel
                 reads an expert's weights again for every (token, expert) slot, and the
                 benchmark decodes batch-invariant (each verify row with its one-token
                 products), so a slot costs `slot_seconds` and nothing is per expert; on one
                 thread while reads are in flight, on every thread where the layer awaits no
                 read (`slot_seconds_all_threads`: ~1.4x faster on 2 cores)
    CPU tier     the experts with no slot: read through a staging area (the same reads on the
                 same threads, while the layer waits), then the same kernel: w / B + latencies
                 + slot_seconds per slot; its hidden states stay on the processor
    dense        the rest of a pass (attention, router, norms, the LM head), per layer: the
                 model's own passes of 1 and k + 1 rows timed with every routed expert
                 skipped (`dense_pass_seconds`: a pass's time and each further row's, as
                 batch-invariant verification runs them: its int8 products take the rows in
                 one call, its attention row by row); where a result lacks them (before these
                 were timed), the in-memory arm's time per token less its expert slots and
                 kernel calls, L (dense + m slot_seconds + call_seconds) = in-memory s / token,
                 each further row priced as the first (a residual of ~10%: fragile)
    overlap      the engine's order, by the engine a result was measured on (`engine_of`):
                 before it computed on arrival, the CPU tier inline, then the slots' one
                 kernel call once every copy it waits for has arrived (`await_all_copies`);
                 since, where a layer awaits a copy, the experts already in their slots in
                 one call while the misses are read (on one thread: the kernel's cost is
                 timed at one), then the CPU tier, then the misses in calls of those arrived
                 by the time the first still awaited is in (`compute_while_reading`). The
                 policy's and driver's decisions on the clock (`decisions_on_clock`, timed
                 as the simulator runs them)

Every fitted figure is a measurement of its own (the probe, the in-memory arm, the kernel and
the checksum timed apart): no tokens/s of an offloaded arm enters the fit, so those arms are
held out entirely. What the profile leaves out: the engine's own bookkeeping per layer beyond
its decisions (locks, thread hand-offs, numpy), the disk shared between the link and the
CPU tier's read-through (each is given the whole bandwidth), and the reads' spread in time
(a read in flight beside three others takes four times as long as the link's sequence says).
"""

from dataclasses import dataclass, field

import numpy as np

from moespec.offload.sim.hardware import HardwareProfile

IO_THREADS = 4  # the engine's reads in flight (moespec.offload.engine.disk.IO_THREADS)
READS_PER_EXPERT = 4  # an int8 expert's runs: gate_up values and scales, down values and scales
UNREAD = 1e15  # B/s: a bandwidth whose bytes cost nothing (the per-slot kernel's w / B term)


@dataclass(frozen=True)
class DiskMeasurements:
    """What the disk profile is fitted from (seconds, bytes), each measured on its own."""

    probe: tuple  # ({"block_bytes", "depth", "bytes_per_second"}, ...): direct-read bandwidth
    expert_bytes: int  # bytes read per expert (the slot stride: its page-aligned runs)
    num_layers: int
    top_k: int
    in_memory_token_seconds: float  # the in-memory arm: decode seconds per decode token
    slot_seconds: float  # the engine's kernel per (token, expert) slot at one row
    call_seconds: float  # the kernel's fixed time per call
    checksum_seconds: float  # CPU time of one expert's checksum (the engine's)
    threads: int = 2
    # ((rows, seconds), ...): the whole model's pass of `rows` tokens, routed experts skipped
    dense_pass_seconds: tuple = ()
    # the kernel per slot on every thread (the engine's where a layer awaits no read); 0:
    # slot_seconds (results before it was timed)
    slot_seconds_all_threads: float = 0.0
    sources: dict = field(default_factory=dict)  # where each figure comes from


class DiskProfileFit:
    """Fits a `HardwareProfile` of the disk tier (see the module docstring) to measurements.

    io_threads: the engine's reads in flight (the probe's depth read); reads_per_expert: the
    reads one expert costs (its runs); compute_while_reading: the engine computes on arrival
    (its order since then; False: the engine before, `await_all_copies`). fit(measurements)
    sets link_bandwidth_, read_latency_, dense_seconds_ (per layer and pass),
    dense_row_seconds_ (per layer and further row of a pass), in_memory_predicted_ (the
    in-memory arm's seconds per token on these terms: a check where the dense time was timed
    apart) and profile_; it returns self."""

    def __init__(
        self,
        io_threads: int = IO_THREADS,
        reads_per_expert: int = READS_PER_EXPERT,
        *,
        compute_while_reading: bool = False,
    ):
        if io_threads < 1 or reads_per_expert < 1:
            raise ValueError("io_threads and reads_per_expert must be >= 1")
        self.io_threads, self.reads_per_expert = io_threads, reads_per_expert
        self.compute_while_reading = compute_while_reading

    def fit(self, m: DiskMeasurements) -> "DiskProfileFit":
        self.link_bandwidth_, self.read_latency_ = probe_line(m.probe, self.io_threads)
        link_latency = self.reads_per_expert * self.read_latency_
        copy_seconds = link_latency + m.expert_bytes / self.link_bandwidth_
        per_layer = m.in_memory_token_seconds / m.num_layers
        if m.dense_pass_seconds:
            passes = dict(m.dense_pass_seconds)
            one, (rows, many) = passes[1], max(passes.items())
            self.dense_seconds_ = one / m.num_layers
            self.dense_row_seconds_ = max(many - one, 0.0) / (rows - 1) / m.num_layers
            self.dense_source_ = "the model's passes timed with their routed experts skipped"
        else:
            self.dense_seconds_ = per_layer - m.top_k * m.slot_seconds - m.call_seconds
            self.dense_row_seconds_ = self.dense_seconds_
            self.dense_source_ = "the in-memory arm less its expert slots and kernel calls"
            if self.dense_seconds_ < 0:
                raise ValueError(
                    f"the in-memory arm's {1e3 * per_layer:.2f} ms per layer is less than its "
                    f"{m.top_k} expert slots and kernel call take "
                    f"({1e3 * m.slot_seconds:.3f} ms a slot): the measurements disagree"
                )
        # what the in-memory arm's one-row pass comes to on these terms, beside what it took
        self.in_memory_predicted_ = m.num_layers * (
            self.dense_seconds_ + m.top_k * m.slot_seconds + m.call_seconds
        )
        flops = 2 * m.expert_bytes / m.slot_seconds  # q / F = slot_seconds (int8: q = 2 w)
        alone = m.slot_seconds_all_threads or m.slot_seconds
        flops_alone = 2 * m.expert_bytes / alone if self.compute_while_reading else 0.0
        self.link_cpu_share_ = min(m.checksum_seconds / copy_seconds, 1.0)
        self.profile_ = HardwareProfile(
            name="disk-ram",
            link_bandwidth=self.link_bandwidth_,
            link_latency=link_latency,
            accelerator_bandwidth=UNREAD,
            accelerator_flops=flops,
            accelerator_flops_alone=flops_alone,
            accelerator_expert_time=0.0,
            accelerator_memory=0.0,
            cpu_bandwidth=self.link_bandwidth_,  # the CPU tier reads its experts through
            cpu_flops=flops,
            cpu_expert_time=link_latency,
            cpu_threads=m.threads,
            layer_time=self.dense_seconds_,
            layer_token_time=self.dense_row_seconds_,
            kernel_call_time=m.call_seconds,
            tier_overlap=0.0,  # one processor, the engine's order (tier_overlap 0 on the CPU)
            decisions_on_clock=True,
            hidden_link=False,
            link_cpu_share=self.link_cpu_share_,
            await_all_copies=not self.compute_while_reading,
            compute_while_reading=self.compute_while_reading,
            note="disk -> RAM slots on this CPU (larger-than-memory engine), fitted",
            sources=tuple(
                {
                    "link_bandwidth": "direct-read probe at the engine's depth: slope over blocks",
                    "link_latency": f"the probe's intercept per read x {self.reads_per_expert}",
                    "accelerator_flops": "the engine's kernel per slot at one row (q / F), on "
                    "one thread (the engine's while reads are in flight)",
                    "accelerator_flops_alone": "the same on every thread (the engine's where a "
                    "layer awaits no read)",
                    "cpu_bandwidth": "the CPU tier reads through: the link's bandwidth",
                    "layer_time": self.dense_source_,
                    "layer_token_time": self.dense_source_ + ": each further row",
                    "link_cpu_share": "an expert's checksum CPU time over its copy time",
                    **m.sources,
                }.items()
            ),
        )
        return self


def probe_line(probe, depth: int) -> tuple[float, float]:
    """(bandwidth B, latency lambda per read) of the line b / B_probe(b) = lambda + b / B
    through the probe's points at `depth` reads in flight (the nearest depth measured), the
    smallest and the largest block: what a read costs a link that makes them one after
    another at the depth's aggregate rate."""
    points = [p for p in probe if "bytes_per_second" in p]
    if not points:
        raise ValueError("the direct-read probe has no measured point")
    nearest = min({p["depth"] for p in points}, key=lambda d: (abs(d - depth), -d))
    at = sorted((p["block_bytes"], p["block_bytes"] / p["bytes_per_second"]) for p in points
                if p["depth"] == nearest)  # fmt: skip
    (b1, t1), (b2, t2) = at[0], at[-1]
    if b2 == b1:
        return b1 / t1, 0.0
    bandwidth = (b2 - b1) / (t2 - t1) if t2 > t1 else b2 / t2
    return bandwidth, max(t1 - b1 / bandwidth, 0.0)


# The engine a measured result ran on.
OLD_ENGINE = {"checksum": "crc32", "compute_while_reading": False}  # before the "engine" block
CHECKSUMS = ("crc32", "page-sum")


def engine_of(result: dict) -> dict:
    """How the disk tier of a larger-than-memory `result` read and computed: its "engine"
    block (written since the engine computes on arrival), else the engine before it (crc32
    checks, a layer computed once every copy had arrived)."""
    engine = {**OLD_ENGINE, **(result.get("engine") or {})}
    if engine["checksum"] not in CHECKSUMS:
        raise ValueError(
            f"the result's engine checks reads with {engine['checksum']!r}; known: "
            f"{', '.join(CHECKSUMS)}"
        )
    return engine


# The measured runs, replayed.
@dataclass
class MeasuredArm:
    """One disk arm of a larger-than-memory result, as the simulator needs it."""

    key: str  # "ARM|ROUTING"
    policy: str
    draft_length: int  # 0: plain decoding
    tokens: int  # decode tokens
    steps: int
    accepted: tuple | None  # accepted drafts per step (None: plain)
    measured: dict  # the result's row


def comparable_settings(
    arm: MeasuredArm,
    *,
    slots: int,
    num_layers: int,
    num_experts: int,
    fit_tokens: int,
    seed: int = 0,
    rejected: bool = False,
):
    """SimulationSettings that take the measured run's steps: its cache of `slots` experts,
    its draft length and accepted drafts, its decode tokens, the fit split of the prompt."""
    from moespec.offload.sim.simulator import SimulationSettings

    return SimulationSettings(
        cache_ratio=(slots + 0.5) / (num_layers * num_experts),  # floor(ratio W) = slots w
        draft_length=arm.draft_length,
        tokens=arm.tokens,
        seed=seed,
        fit_tokens=fit_tokens,
        bytes_per_parameter=1.0,  # int8: the profile's FLOP rate is per slot
        rejected_routing="trace" if rejected else "continuation",
        accepted=arm.accepted,
    )


def compare(measured: dict, simulated: dict, expert_bytes: int, tolerance: float = 0.2) -> dict:
    """Measured against simulated for one arm: tokens/s and their ratio (simulated / measured),
    hit rates, bytes read per token (the simulator's copies plus its CPU tier's experts, which
    the disk tier reads through), and whether the ratio lies within 1 +- `tolerance`."""
    tokens = max(simulated["tokens"], 1)
    read = simulated["bytes_copied"] + simulated["cpu_experts"] * expert_bytes
    ratio = simulated["tokens_per_second"] / measured["tokens_per_second"]
    return {
        "measured_tokens_per_second": measured["tokens_per_second"],
        "simulated_tokens_per_second": simulated["tokens_per_second"],
        "ratio": ratio,
        "within": within(ratio, tolerance),
        "measured_hit_rate": measured.get("hit_rate"),
        "simulated_hit_rate": simulated["hit_rate"],
        "measured_bytes_read_per_token": measured.get("bytes_read_per_token"),
        "simulated_bytes_read_per_token": read / tokens,
        "measured_cpu_experts_per_token": measured.get("cpu_experts", 0) / tokens,
        "simulated_cpu_experts_per_token": simulated["cpu_experts"] / tokens,
        "measured_stall_seconds_per_token": measured.get("stall_seconds_per_token"),
        "simulated_copy_wait_seconds_per_token": simulated["copy_wait_seconds"] / tokens,
        "measured_steps": measured.get("steps"),
        "simulated_steps": simulated["steps"],
    }


def within(ratio: float, tolerance: float = 0.2) -> bool:
    """Simulated / measured within +-`tolerance` of measured: |sim - meas| <= tol meas."""
    return bool(abs(ratio - 1.0) <= tolerance + 1e-12)


def verdict(rows: dict, tolerance: float = 0.2) -> dict:
    """Per policy (arm), pass or fail; the calibration passes only if every compared arm does
    and at least one was compared. rows: {key: compare(...) or {"comparable": False, ...}}."""
    compared = {k: r for k, r in rows.items() if r.get("comparable", True)}
    per_arm = {k: bool(r["within"]) for k, r in compared.items()}
    worst = max(compared.values(), key=lambda r: abs(r["ratio"] - 1), default=None)
    return {
        "tolerance": tolerance,
        "per_arm": per_arm,
        "not_comparable": sorted(set(rows) - set(compared)),
        "passed": bool(per_arm) and all(per_arm.values()),
        "worst_ratio": None if worst is None else worst["ratio"],
    }


def trace_of(ids, num_experts: int, expert_bytes: int, layer_indices, model: str = ""):
    """A RoutingTrace of one sequence's expert ids [T, L, m], every expert `expert_bytes`."""
    from moespec.routing import RoutingTrace

    ids = np.asarray(ids, dtype=np.int64)
    return RoutingTrace(
        ids, [0, len(ids)], ["sequence"], int(num_experts),
        [int(expert_bytes)] * ids.shape[1], list(layer_indices), model=model,
    )  # fmt: skip


def measure_engine_costs(
    hidden_size: int,
    intermediate_size: int,
    expert_bytes: int,
    *,
    kernel: str = "slot",
    top_k: int = 8,
    repeats: int = 21,
    store_experts: int = 24,
    checksum: str = "page-sum",
) -> dict:
    """The engine's own per-expert costs on this CPU, timed apart from any run: its `kernel`
    on int8 experts of the model's shape at one row, `top_k` experts a call against one
    (interleaved medians over a store of `store_experts`, successive calls taking successive
    experts, as the engine's calls read experts the cache does not hold): slot_seconds (per
    expert slot) and call_seconds (a call's fixed time); and checksum_seconds, the CPU time
    of the `checksum` the disk tier takes of each expert read (median of `repeats`, over
    the store's experts in turn, as the reads leave them in memory rather than the cache):
    "crc32" (zlib's, the engine before it computed on arrival) or "page-sum"
    (`expert_checksum`)."""
    import itertools
    import statistics
    import time

    import torch

    from moespec.kernels import ExpertWeights, get_kernel
    from moespec.offload.sim.hardware import _interleaved_medians

    count = max(store_experts // top_k, 2) * top_k
    experts = ExpertWeights(
        torch.randn(count, 2 * intermediate_size, hidden_size, dtype=torch.bfloat16),
        torch.randn(count, hidden_size, intermediate_size, dtype=torch.bfloat16),
    ).quantize_int8()
    run_kernel = get_kernel(kernel)

    def call(width: int):
        x = torch.randn(1, hidden_size, dtype=torch.bfloat16)
        gates = torch.full((1, width), 1.0 / width)
        ids = itertools.cycle(
            [torch.arange(f, f + width)[None] for f in range(0, count - width + 1, width)]
        )

        def run():
            with torch.inference_mode():
                return run_kernel(x, next(ids), gates, experts)

        return run

    times = _interleaved_medians({"one": call(1), "call": call(top_k)}, repeats)
    slot = (times["call"] - times["one"]) / (top_k - 1)
    experts = None  # the kernel's store released: the checks' takes its place
    check = checksum_function(checksum)
    store = np.random.default_rng(0).integers(0, 256, count * int(expert_bytes), dtype=np.uint8)
    data = [memoryview(part) for part in np.split(store, count)]  # [count] experts' bytes
    check(data[-1])  # warm (the page-sum's weights, numpy's first call)
    checks = []
    for i in range(repeats):  # successive experts: bytes just read are in memory, not cache
        start = time.thread_time()
        check(data[i % count])
        checks.append(time.thread_time() - start)
    return {
        "slot_seconds": slot,
        "call_seconds": max(times["one"] - slot, 0.0),
        "checksum_seconds": statistics.median(checks),
        "checksum": checksum,
        "kernel": kernel,
        "threads": torch.get_num_threads(),
        "medians_seconds": times,
    }


def measure_dense_passes(model, prompt, rows=(1, 5), repeats: int = 11) -> dict:
    """{rows: seconds} of the model's own pass of `rows` tokens after `prompt`, with every
    routed expert skipped (an executor that returns zeros: attention, routers, norms, shared
    experts and the LM head, as the model is set: its dtype, batch invariance and threads),
    interleaved medians over `repeats`; the cache is rolled back after each pass."""
    import torch

    from moespec.models.transformer import no_experts
    from moespec.offload.sim.hardware import _interleaved_medians

    cache = model.new_cache(capacity=len(prompt) + max(rows))
    model.forward(torch.tensor(prompt), cache, offload=no_experts)
    start = cache.length

    def run(n: int):
        tokens = torch.tensor(prompt[-n:])

        def one():
            model.forward(tokens, cache, all_logits=True, offload=no_experts)
            cache.rollback(start)

        return one

    return _interleaved_medians({n: run(n) for n in rows}, repeats)


def checksum_function(name: str):
    """The disk tier's check of an expert's bytes by name (see CHECKSUMS)."""
    if name == "crc32":
        import zlib

        return zlib.crc32
    if name == "page-sum":
        from moespec.offload.engine.disk import expert_checksum

        return expert_checksum
    raise ValueError(f"unknown checksum {name!r}; known: {', '.join(CHECKSUMS)}")
