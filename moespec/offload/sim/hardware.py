"""Hardware profiles for the offload simulator: the link, the accelerator and the CPU, in numbers.

A profile is what the timing model of `moespec.offload.sim.simulator` needs and nothing else:

    link_bandwidth, link_latency          host -> accelerator copies of expert weights
    accelerator_bandwidth, _flops, _expert_time, accelerator_memory
    cpu_bandwidth, cpu_flops, cpu_expert_time, cpu_threads
    host_memory_bandwidth                 what CPU expert reads and copies share (0: unshared)
    layer_time, step_time, draft_token_time   fixed costs per layer of a pass, per step, per
                                          drafted token (launches, synchronisation, LM head)
    layer_token_time                      per layer and pass token beyond the first
    tier_overlap, decisions_on_clock      one processor for both tiers (this machine)
    hidden_link, link_cpu_share, await_all_copies, compute_while_reading
                                          a disk tier's engine (`sim.disk_tier`)
    offload_layer_time, _split_time       the offload engine's bookkeeping per layer pass

Bandwidths are *effective* figures (what a copy or an expert kernel reaches), not datasheet
peaks; each preset says which nominal figure it starts from and why it is lowered. They are
modelling assumptions fixed before any simulation was run, not fitted to a result.

`measure_this_machine()` builds a CPU-only profile from small measurements of the engine's own
expert kernels and copy thread on the machine it runs on; `load_profile(path)` reads any
profile from JSON (a calibration file).
"""

import json
import os
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

GB = 1e9


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    link_bandwidth: float  # bytes/s of host -> accelerator copies (effective)
    link_latency: float  # s added to each copy (DMA set-up, synchronisation)
    accelerator_bandwidth: float  # bytes/s an expert kernel reads weights at on the accelerator
    accelerator_flops: float  # FLOP/s of the expert kernel on the accelerator
    accelerator_expert_time: float  # s of fixed time per expert computed on the accelerator
    accelerator_memory: float  # bytes of accelerator memory (for reporting; budgets are ratios)
    cpu_bandwidth: float  # bytes/s an expert kernel reads weights at on the CPU (all threads)
    cpu_flops: float  # FLOP/s of the expert kernel on the CPU (all threads)
    cpu_expert_time: float  # s of fixed time per expert computed on the CPU (dispatch, sync)
    cpu_threads: int  # threads the CPU figures were taken at (provenance; figures are totals)
    note: str = ""
    host_memory_bandwidth: float = 0.0  # bytes/s host memory serves CPU reads + copies (0: inf)
    layer_time: float = 0.0  # s fixed per MoE layer of a pass (attention, router, sync, launches)
    step_time: float = 0.0  # s fixed per step (LM head, sampling, host synchronisation)
    draft_token_time: float = 0.0  # s per drafted token beyond reading the draft's bytes
    layer_token_time: float = 0.0  # s per pass token beyond the first, per layer, outside
    # the experts (attention rows, batch-invariant products: 0 where a pass reads its weights
    # once and compute is free, as on the GPU profiles)
    kernel_call_time: float = 0.0  # s per expert-kernel call a tier makes in a layer (the
    # engine's dispatch around the products; one call in memory, one per tier when split)
    tier_overlap: float = 1.0  # share of the shorter tier's work hidden under the longer one
    decisions_on_clock: bool = False  # the policy's own wall time counts (this machine)
    offload_layer_time: float = 0.0  # s per layer pass the offload engine's own bookkeeping
    # adds beyond its kernels and decisions (routing to numpy, plan lock, timings, and what
    # the decisions cost more between its kernels than the simulator times them back to
    # back): measured on this machine; 0 where a preset's layer_time holds it
    offload_split_time: float = 0.0  # s more where a layer's experts run on both tiers (the
    # gathers of each tier's rows and the scatter of their results)
    # How a disk tier's engine differs (False, 1, False on every other profile): whether the
    # CPU tier's hidden states cross the link (not where it is the processor that computes),
    # the share of a copy's time that occupies that processor (a disk read's checksum; 1:
    # the copy is the processor's own work, as a memory copy on `this-machine`), and whether
    # the accelerator's kernel starts only once every copy it waits for has arrived (one
    # kernel call per layer, as the CPU engine makes it) rather than expert by expert; or,
    # the disk tier's order since it computes on arrival (compute_while_reading): the experts
    # already in RAM in one call while the misses are read, then the CPU tier, then the misses
    # in calls of those arrived by the time the first still awaited is in.
    hidden_link: bool = True
    link_cpu_share: float = 1.0
    await_all_copies: bool = False
    compute_while_reading: bool = False
    # compute_while_reading: the FLOP/s of the accelerator's kernel where it awaits no copy
    # (the disk tier's kernel then runs on every thread, on one while reads are in flight;
    # 0: accelerator_flops)
    accelerator_flops_alone: float = 0.0
    sources: tuple = ()  # (field, where its number comes from) pairs

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "note", "sources") or f.type in (bool, "bool"):
                continue
            if not isinstance(value, int | float) or value < 0:
                raise ValueError(f"profile {self.name!r}: {f.name} must be a number >= 0")
        for name in ("link_bandwidth", "accelerator_bandwidth", "cpu_bandwidth"):
            if getattr(self, name) <= 0:
                raise ValueError(f"profile {self.name!r}: {name} must be positive")
        for name in ("tier_overlap", "link_cpu_share"):
            if getattr(self, name) > 1:
                raise ValueError(f"profile {self.name!r}: {name} must be in [0, 1]")
        if self.await_all_copies and self.compute_while_reading:
            raise ValueError(
                f"profile {self.name!r}: await_all_copies and compute_while_reading are two "
                "engines' orders: set one"
            )
        if 0 < self.host_memory_bandwidth <= self.link_bandwidth:
            raise ValueError(
                f"profile {self.name!r}: link_bandwidth ({self.link_bandwidth:.3g} B/s) must be "
                f"below host_memory_bandwidth ({self.host_memory_bandwidth:.3g} B/s): the copies "
                "read host memory (or set host_memory_bandwidth to 0, unshared)"
            )
        for name in ("accelerator_flops", "cpu_flops"):
            if getattr(self, name) <= 0:
                raise ValueError(f"profile {self.name!r}: {name} must be positive")

    def to_dict(self) -> dict:
        return asdict(self)


# PCIe 4.0 x16 is 32 GB/s nominal (31.5 GB/s after 128b/130b coding). Pinned host-to-device
# copies reach about 25 GB/s once TLP headers and flow control are paid: we use 25 GB/s.
PCIE4_EFFECTIVE = 25 * GB
PCIE_COPY_LATENCY = 10e-6

_PCIE = (
    ("link_bandwidth", "PCIe 4.0 x16: 31.5 GB/s after coding; pinned H2D copies reach ~25 GB/s"),
    ("link_latency", "cudaMemcpyAsync set-up and event, ~10 us per copy"),
)
_RTX4090 = (
    ("accelerator_bandwidth", "RTX 4090 GDDR6X 1008 GB/s nominal; grouped expert GEMVs ~80%"),
    ("accelerator_flops", "RTX 4090 dense bf16 tensor cores 165 TFLOP/s nominal, ~90%"),
    ("accelerator_expert_time", "one kernel launch / tile set-up per expert, ~5 us"),
    (
        "layer_time",
        "attention + router + norm kernels of a decoder layer, ~12 launches at ~5 us"
        " each, and the ggml graph split's CPU-GPU synchronisation at a layer with CPU work",
    ),
    ("step_time", "LM head (151936 x 2048 f16 = 0.62 GB at 800 GB/s = 0.8 ms) and sampling"),
    (
        "draft_token_time",
        "the draft's small kernels (norms, RoPE, short attention, residual adds: ~8 of ~12 per"
        " layer x 36 layers) at a kernel's ~2.5 us floor; its matrix products are its bytes",
    ),
)
_AMX_HOST = (
    (
        "cpu_bandwidth",
        "seed 003 App. H.2: a single-activation CPU fallback with AMX is within a 50% latency"
        " gap of GPU execution; at Qwen3-30B-A3B's 9.44 MB expert, 1.5 x this profile's GPU"
        " expert time (25.2 us) less cpu_expert_time reads at 407 GB/s: a 12-channel"
        " DDR5-6400 Xeon 6 (AMX) socket, 614 GB/s nominal, at 66%",
    ),
    ("cpu_flops", "AMX bf16 tiles, ~20 TFLOP/s reached by small GEMMs on 32 cores"),
    (
        "cpu_expert_time",
        "per expert inside one multi-expert CPU op (tile configuration, loop start), ~2 us;"
        " the op's dispatch is in the per-layer hidden-state round trip",
    ),
    (
        "host_memory_bandwidth",
        "the same DDR5 channels serve the CPU and the copy engine: ~460 GB/s in all"
        " (75% of nominal)",
    ),
)
_AVX2_HOST = (
    (
        "cpu_bandwidth",
        "desktop dual-channel DDR5-5600: 89.6 GB/s nominal, ~60 GB/s reached; seed 003's own"
        " host reads about as fast on llama.cpp's f16 CPU path: App. G's llama.cpp layer, CPU"
        " bound, of 8 Qwen3-30B-A3B experts (75.5 MB) in 1.26-1.35 ms is 56-60 GB/s; on this"
        " profile the calibration gate's llama.cpp runs at 13.5 tokens/s (Table 1: 15.23)",
    ),
    ("cpu_flops", "AVX2 bf16->fp32 FMA on 16 cores, ~0.8 TFLOP/s"),
    ("cpu_expert_time", "thread-pool dispatch and join per expert, ~20 us"),
    ("host_memory_bandwidth", "the same two channels serve CPU and copies: ~70 GB/s in all"),
)

PROFILES: dict[str, HardwareProfile] = {
    p.name: p
    for p in [
        HardwareProfile(
            # seed 003's setting: an RTX 4090 on PCIe 4.0, an AMX host (App. H.2): its CPU
            # computes one expert in 1.5 x the GPU's time, as H.2 reports.
            name="rtx4090-pcie4",
            link_bandwidth=PCIE4_EFFECTIVE,
            link_latency=PCIE_COPY_LATENCY,
            accelerator_bandwidth=800 * GB,
            accelerator_flops=150e12,
            accelerator_expert_time=5e-6,
            accelerator_memory=24 * GB,
            cpu_bandwidth=407 * GB,
            cpu_flops=20e12,
            cpu_expert_time=2e-6,
            cpu_threads=32,
            host_memory_bandwidth=460 * GB,
            layer_time=0.3e-3,
            step_time=1.0e-3,
            draft_token_time=0.7e-3,
            note="RTX 4090 24 GB on PCIe 4.0 x16 (25 of 32 GB/s), AMX host (Xeon 6 class)",
            sources=_PCIE + _RTX4090 + _AMX_HOST,
        ),
        HardwareProfile(
            name="rtx4090-avx2",
            link_bandwidth=PCIE4_EFFECTIVE,
            link_latency=PCIE_COPY_LATENCY,
            accelerator_bandwidth=800 * GB,
            accelerator_flops=150e12,
            accelerator_expert_time=5e-6,
            accelerator_memory=24 * GB,
            cpu_bandwidth=60 * GB,
            cpu_flops=0.8e12,
            cpu_expert_time=20e-6,
            cpu_threads=16,
            host_memory_bandwidth=70 * GB,
            layer_time=0.3e-3,
            step_time=1.0e-3,
            draft_token_time=0.7e-3,
            note="RTX 4090 24 GB on PCIe 4.0 x16 (25 of 32 GB/s), AVX2 desktop DDR5 host",
            sources=_PCIE + _RTX4090 + _AVX2_HOST,
        ),
        HardwareProfile(
            name="a100-pcie4",
            link_bandwidth=PCIE4_EFFECTIVE,
            link_latency=PCIE_COPY_LATENCY,
            accelerator_bandwidth=1600 * GB,
            accelerator_flops=250e12,
            accelerator_expert_time=5e-6,
            accelerator_memory=80 * GB,
            cpu_bandwidth=120 * GB,
            cpu_flops=1.5e12,
            cpu_expert_time=20e-6,
            cpu_threads=32,
            host_memory_bandwidth=150 * GB,
            layer_time=0.3e-3,
            step_time=1.0e-3,
            draft_token_time=0.7e-3,
            note="A100-80GB on PCIe 4.0 x16 (25 of 32 GB/s), 8-channel DDR4 server socket",
            sources=_PCIE
            + (
                ("accelerator_bandwidth", "A100-80GB HBM2e 1935-2039 GB/s nominal, ~80%"),
                ("accelerator_flops", "bf16 dense 312 TFLOP/s nominal, ~80%"),
                ("cpu_bandwidth", "8-channel DDR4-3200: 204.8 GB/s nominal, ~120 GB/s reached"),
                ("cpu_flops", "AVX-512 bf16 on 32 cores, ~1.5 TFLOP/s"),
                ("host_memory_bandwidth", "the same channels for CPU and copies: ~150 GB/s"),
                ("layer_time", "as the RTX 4090 profile (launch-bound)"),
                ("step_time", "as the RTX 4090 profile"),
            ),
        ),
    ]
}

THIS_MACHINE = "this-machine"


def profile_names() -> list[str]:
    return [*PROFILES, THIS_MACHINE]


def get_profile(name: str) -> HardwareProfile:
    """A preset by name, `this-machine` (measured now), or a JSON profile file by path."""
    if name in PROFILES:
        return PROFILES[name]
    if name == THIS_MACHINE:
        return measure_this_machine()
    if name.endswith(".json") or os.path.sep in name:
        return load_profile(name)
    raise ValueError(f"unknown hardware profile {name!r} (known: {', '.join(profile_names())})")


def load_profile(path) -> HardwareProfile:
    """Read a profile (all fields of HardwareProfile) from a JSON file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error.msg} at line {error.lineno})") from None
    names = {f.name for f in fields(HardwareProfile)}
    optional = {f.name for f in fields(HardwareProfile) if f.default is not MISSING}
    missing = sorted(names - set(data) - optional)
    if missing:
        raise ValueError(f"{path}: profile lacks {', '.join(missing)}")
    return HardwareProfile(**{k: v for k, v in data.items() if k in names})


def _typical_time(fn, repeats: int) -> float:
    """The median of `repeats` runs after two warm-ups: what a run typically costs here (the
    engine pays typical runs; the best of a few moved 2.7x between profiles on a busy host)."""
    import statistics

    from moespec.calibrate.timing import time_runs

    return statistics.median(time_runs(fn, repeats=repeats, warmup=2))


def _store_bytes(store_bytes: int | None) -> int:
    """The bytes of a store to time over: as given up to four times the last-level cache (a
    bigger one meets the cache no less rarely), else twice it (the cache taken as 32 MiB where
    Linux does not say)."""
    from moespec.calibrate.timing import last_level_cache_bytes

    cache = last_level_cache_bytes() or 32 << 20
    return 2 * cache if store_bytes is None else min(int(store_bytes), 4 * cache)


def _store_of_experts(
    hidden_size: int, intermediate_size: int, store_bytes: int, multiple=1, dtype=None, packed=False
):
    """Experts (float32 unless `dtype`; packed as `_one_expert` says) filling `store_bytes`
    (at least 2, a multiple of `multiple`)."""
    import torch

    itemsize = (dtype or torch.float32).itemsize
    w = 3 * hidden_size * intermediate_size * itemsize
    count = max(2, -(-store_bytes // w))
    count = -(-count // multiple) * multiple
    return _one_expert(hidden_size, intermediate_size, count, dtype, packed)


def _one_expert(hidden_size: int, intermediate_size: int, count: int = 1, dtype=None, packed=False):
    """`count` experts (float32 unless `dtype`) of the given size as the engine's store holds
    them: unpacked, or with `packed` in the layout `ExpertWeights.pack` gives them here."""
    import torch

    from moespec.kernels import ExpertWeights

    dtype = dtype or torch.float32
    experts = ExpertWeights(
        torch.randn(count, 2 * intermediate_size, hidden_size).to(dtype),
        torch.randn(count, hidden_size, intermediate_size).to(dtype),
    )
    return experts.pack() if packed else experts


def _expert_run(experts, tokens: int, expert: int = 0):
    """f(): moespec's deduplicating kernel applying `expert` to `tokens` rows."""
    import torch

    from moespec.kernels import get_kernel

    run_kernel = get_kernel("dedup")
    x = torch.randn(tokens, experts.hidden_size, dtype=experts.dtype)
    gates = torch.ones(tokens, 1)
    ids = torch.full((tokens, 1), expert, dtype=torch.long)

    def run():
        with torch.inference_mode():
            return run_kernel(x, ids, gates, experts)

    return run


def measure_this_machine(
    hidden_size: int = 2048,
    intermediate_size: int = 768,
    repeats: int = 31,
    kernel=None,
    store_bytes: int | None = None,
    pool_bytes: int | None = None,
    dtype=None,
    packed: bool = False,
    pass_tokens: int = 16,
) -> HardwareProfile:
    """A CPU-only profile measured here: both tiers are this CPU, the link is a memory copy.

    link_bandwidth, link_latency: the engine's own link (`link_times`): one expert fetched
    through its copy thread, from the hand-off to the copy done, at two sizes, between a
    store of `store_bytes` and a pool of `pool_bytes` (the engine's; see `link_times`).
    The expert times are the engine's `kernel` (moespec's deduplicating kernel when None)
    called as a tier calls it, and fitted to the timing model's terms (`_kernel_fit`):
    kernel_call_time from a call of one expert against one of `CALL_EXPERTS` (one row, each
    expert named once), cpu/accelerator bandwidth and expert time from the time per expert
    at the expert's size against 1/16 of it, and the FLOP rate from those experts on
    `pass_tokens` rows against one row (for the per-slot kernel this is the re-reading of
    the weights per slot, which the model's per-slot term then carries). Each time is the
    median of `repeats` calls, each call taking the next experts of a store of
    `store_bytes`, as the engine's calls read experts the cache does not hold.
    The expert is float32 unless `dtype` names the engine's: torch's CPU bf16 matvec paths
    vary by shape by up to 100x, so a bf16 engine is probed in bf16 at its own shape (an
    H200 host's CPU tier ran bf16 experts at 13-16 GB/s, whole steps counted, where an fp32
    probe read 71); with `packed`, the experts are in the layout `ExpertWeights.pack` gives
    them, as the engine's store holds a packed model's experts on the CPU. Both tiers share
    one memory bus here, which the timing model does not know: the profile is for relative
    comparisons.
    """
    import torch

    threads = torch.get_num_threads()
    link_latency, link_bandwidth = link_times(
        hidden_size, intermediate_size, store_bytes=store_bytes, pool_bytes=pool_bytes
    )
    fit = _kernel_fit(
        kernel or "dedup",
        hidden_size,
        intermediate_size,
        _store_bytes(store_bytes),
        repeats=repeats,
        dtype=dtype,
        packed=packed,
        pass_tokens=pass_tokens,
    )
    overlap = tier_overlap(hidden_size, intermediate_size, repeats, dtype, packed)
    return HardwareProfile(
        name=THIS_MACHINE,
        link_bandwidth=link_bandwidth,
        link_latency=link_latency,
        accelerator_bandwidth=fit["bandwidth"],
        accelerator_flops=fit["flops"],
        accelerator_expert_time=fit["expert_time"],
        accelerator_memory=0.0,
        cpu_bandwidth=fit["bandwidth"],
        cpu_flops=fit["flops"],
        cpu_expert_time=fit["expert_time"],
        cpu_threads=threads,
        kernel_call_time=fit["call_time"],
        tier_overlap=overlap,
        decisions_on_clock=True,
        note=f"measured with torch {torch.__version__} on {threads} threads"
        + (f", {dtype} experts" if dtype is not None else "")
        + (", packed" if packed else "")
        + f", {kernel or 'dedup'} kernel",
        sources=(
            (
                "link_bandwidth",
                "measured: fetches through the engine's link thread, at the expert's size and"
                " a quarter of it, the slope of the medians",
            ),
            ("link_latency", "measured: the same two points' intercept (the thread hand-off)"),
            (
                "cpu_bandwidth",
                f"measured: the engine's kernel on 1 and {CALL_EXPERTS} experts a call (time per"
                " expert), at the expert's size and at 1/16 of it, the slope; medians over a"
                " store of the engine's bytes (successive calls take successive experts, so"
                " they read memory the cache does not hold)",
            ),
            ("cpu_expert_time", "measured: the same time per expert's intercept"),
            ("kernel_call_time", "measured: a call's time beyond its one expert's"),
            (
                "cpu_flops",
                f"measured: {CALL_EXPERTS} experts on {pass_tokens} rows against one row",
            ),
            ("tier_overlap", "measured: two experts in two threads against one alone"),
            ("decisions_on_clock", "the engine's policy runs in Python on these cores"),
        ),
    )


CALL_EXPERTS = 8  # experts in the larger probe call: an OLMoE-like top-k pass on one token


def _kernel_fit(
    kernel: str,
    hidden_size: int,
    intermediate_size: int,
    store_bytes: int,
    *,
    repeats: int = 31,
    dtype=None,
    packed: bool = False,
    pass_tokens: int = 16,
) -> dict:
    """The timing model's terms for a moespec expert kernel on this CPU, as a tier calls it:

        call(E experts of w bytes, c rows each) = call_time + E (expert_time + w / bandwidth
                                                                 + c q / flops)
                                                                     (q = 2 w / itemsize)

    Five medians, the calls interleaved (`_interleaved_medians`): E = 1 and CALL_EXPERTS at
    the expert's size and at 1/16 of it (one row), and CALL_EXPERTS experts on `pass_tokens`
    rows. For the per-slot kernel, which reads an expert's weights again for each of its
    rows, the per-slot term carries most of a read and
    `bandwidth` only what the first row costs beyond it: the figures are the kernel's terms
    in the model, not the memory's. Fitting E = 1 alone at two sizes (as an earlier probe
    did) folds the call's fixed time into the bandwidth: on a 2-core AMX host it read 15 GB/s
    where the same kernel streams 28 GB/s in a call of 8 experts."""
    import itertools

    import torch

    from moespec.kernels import get_kernel

    run_kernel = get_kernel(kernel)

    def call(store, experts: int, rows: int = 1):
        x = torch.randn(rows, store.hidden_size, dtype=store.dtype)
        gates = torch.full((rows, experts), 1.0 / experts)
        firsts = range(0, store.num_experts - experts + 1, experts)
        ids = [torch.arange(f, f + experts).expand(rows, experts).contiguous() for f in firsts]
        order = itertools.cycle(ids)

        def run():
            with torch.inference_mode():
                return run_kernel(x, next(order), gates, store)

        return run

    many, rows = CALL_EXPERTS, max(int(pass_tokens), 2)
    full = _store_of_experts(hidden_size, intermediate_size, store_bytes, many, dtype, packed)
    small = _store_of_experts(
        hidden_size // 4, intermediate_size // 4, store_bytes, many, dtype, packed
    )
    runs = {
        "one": call(full, 1), "row": call(full, many), "rows": call(full, many, rows),
        "small_one": call(small, 1), "small_row": call(small, many),
    }  # fmt: skip
    times = _interleaved_medians(runs, repeats)
    itemsize = (dtype or torch.float32).itemsize
    w, w_small = full.bytes_per_expert, small.bytes_per_expert
    return kernel_terms(times, w, w_small, many, rows, itemsize)


def _interleaved_medians(runs: dict, repeats: int) -> dict:
    """{name: the median seconds of runs[name]()} over `repeats` rounds that run each once,
    in an order rotated every round, after two rounds of warm-up: a slow phase of the host
    falls on every call alike (the fit takes differences of these medians)."""
    import statistics
    import time

    names, seconds = list(runs), {name: [] for name in runs}
    for r in range(repeats + 2):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            runs[name]()
            if r >= 2:
                seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in seconds.items()}


def kernel_terms(times: dict, w: int, w_small: int, many: int, rows: int, itemsize: int) -> dict:
    """`_kernel_fit`'s terms from its five medians (seconds): `one` and `row` (1 and `many`
    experts on one row), `rows` (`many` experts on `rows` rows), and `small_one`,
    `small_row` (the same two calls on experts of `w_small` bytes, not `w`)."""
    per_expert = (times["row"] - times["one"]) / (many - 1)
    per_slot = max(times["rows"] - times["row"], 1e-12) / (many * (rows - 1))  # q / flops
    small_per_expert = (times["small_row"] - times["small_one"]) / (many - 1)
    # The model charges every slot q / flops, the first too: take it out of the one-row
    # times before fitting the bytes (q grows with the bytes).
    reads, small_reads = per_expert - per_slot, small_per_expert - per_slot * w_small / w
    bandwidth = (w - w_small) / max(reads - small_reads, 1e-12)
    return {
        "bandwidth": bandwidth,
        "expert_time": max(small_reads - w_small / bandwidth, 0.0),
        "call_time": max(times["one"] - per_expert, 0.0),
        "flops": 2 * (w / itemsize) / per_slot,
    }


def link_times(
    hidden_size: int,
    intermediate_size: int,
    copies: int = 200,
    store_bytes: int | None = None,
    pool_bytes: int | None = None,
) -> tuple[float, float]:
    """(s per copy beyond its bytes, bytes/s) of the offload engine's link on this CPU.

    A fetch as the executor makes one: a `CopyJob` handed to the engine's `Link` thread under
    its lock, then waited for until issued. The median round trip of `copies` fetches at the
    expert's size and at half its hidden and intermediate sizes (a quarter of the bytes) gives
    two points on t = latency + bytes / bandwidth. The fetches read a store of `store_bytes`
    and write a slot pool of `pool_bytes` (the engine's expert bytes and cache budget; each
    twice the last-level cache by default, at most four times it: `_store_bytes`): whether
    the engine's copies meet the cache depends on both. The pool is written once first
    (`SlotPool` does it at creation), as the engine's slots are after warm-up. The median, not
    the best: the engine pays the hand-off it gets, and a thread's wake-up varies.
    """
    import statistics
    import threading
    import time

    from moespec.offload.engine.tiers import CopyJob, CpuBackend, ExpertStore, Link, SlotPool

    store_bytes, pool_bytes = _store_bytes(store_bytes), _store_bytes(pool_bytes)

    def median_fetch(h: int, i: int) -> tuple[float, int]:
        w = 3 * h * i * 4  # one float32 expert
        count, slots = max(2, -(-store_bytes // w)), max(2, -(-pool_bytes // w))
        experts = _one_expert(h, i, count)
        backend, lock = CpuBackend(), threading.Condition()
        store = ExpertStore([experts], backend)
        pool = SlotPool(slots, experts, backend.device)
        link = Link(pool, store, backend, lock, lambda: None, lambda job: None)
        times = []
        try:
            for n in range(copies + 4):  # the first four warm the thread
                job = CopyJob(0, n % count, n % slots, "fetch")
                start = time.perf_counter()
                with lock:
                    link.fetches.append(job)
                    if link.waiting:
                        lock.notify_all()
                while not job.wait_issued(0.5):
                    if link.error is not None:
                        raise link.error
                times.append(time.perf_counter() - start)
        finally:
            link.close()
        return statistics.median(times[4:]), experts.bytes_per_expert

    # Both points cycle through stores and pools of the same bytes: the same share of cache.
    big, big_bytes = median_fetch(hidden_size, intermediate_size)
    small, small_bytes = median_fetch(max(hidden_size // 2, 1), max(intermediate_size // 2, 1))
    bandwidth = (big_bytes - small_bytes) / max(big - small, 1e-9)
    return max(small - small_bytes / bandwidth, 0.0), bandwidth


def tier_overlap(
    hidden_size: int, intermediate_size: int, repeats: int = 31, dtype=None, packed=False
) -> float:
    """How far two tiers' expert work overlaps on this machine, in [0, 1]: the engine's kernel
    on one expert alone (t1) against two experts at once in two threads (t2), 2 - t2 / t1 (1:
    in parallel, as two devices; 0: one after the other, as on one busy core)."""
    import threading

    experts = _one_expert(hidden_size, intermediate_size, 2, dtype, packed)
    runs = [_expert_run(experts, 1, expert) for expert in (0, 1)]

    def product(run, times=20):
        for _ in range(times):
            run()

    def both():
        threads = [threading.Thread(target=product, args=(run,)) for run in runs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    alone = _typical_time(lambda: product(runs[0]), repeats)
    together = _typical_time(both, repeats)
    return min(max(2.0 - together / alone, 0.0), 1.0)
