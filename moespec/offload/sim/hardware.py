"""Hardware profiles for the offload simulator: the link, the accelerator and the CPU, in numbers.

A profile is what the timing model of `moespec.offload.sim.simulator` needs and nothing else:

    link_bandwidth, link_latency          host -> accelerator copies of expert weights
    accelerator_bandwidth, _flops, _expert_time, accelerator_memory
    cpu_bandwidth, cpu_flops, cpu_expert_time, cpu_threads

Bandwidths are *effective* figures (what a copy or an expert kernel reaches), not datasheet
peaks; each preset says which nominal figure it starts from and why it is lowered. They are
modelling assumptions fixed before any simulation was run, not fitted to a result.

`measure_this_machine()` builds a CPU-only profile from two small torch measurements on the
machine it runs on; `load_profile(path)` reads any profile from JSON (a calibration file).
"""

import json
import os
import time
from dataclasses import asdict, dataclass, fields
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

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "note"):
                continue
            if not isinstance(value, int | float) or value < 0:
                raise ValueError(f"profile {self.name!r}: {f.name} must be a number >= 0")
        for name in ("link_bandwidth", "accelerator_bandwidth", "cpu_bandwidth"):
            if getattr(self, name) <= 0:
                raise ValueError(f"profile {self.name!r}: {name} must be positive")
        for name in ("accelerator_flops", "cpu_flops"):
            if getattr(self, name) <= 0:
                raise ValueError(f"profile {self.name!r}: {name} must be positive")

    def to_dict(self) -> dict:
        return asdict(self)


# PCIe 4.0 x16 is 32 GB/s nominal (31.5 GB/s after 128b/130b coding). Pinned host-to-device
# copies reach about 25 GB/s once TLP headers and flow control are paid: we use 25 GB/s.
PCIE4_EFFECTIVE = 25 * GB
PCIE_COPY_LATENCY = 10e-6

PROFILES: dict[str, HardwareProfile] = {
    p.name: p
    for p in [
        HardwareProfile(
            name="rtx4090-pcie4",
            link_bandwidth=PCIE4_EFFECTIVE,
            link_latency=PCIE_COPY_LATENCY,
            # 1008 GB/s GDDR6X nominal; small grouped expert GEMVs reach about 80% of it.
            accelerator_bandwidth=800 * GB,
            accelerator_flops=150e12,  # bf16 tensor cores, dense (165 TFLOP/s nominal)
            accelerator_expert_time=5e-6,  # a kernel launch / tile set-up per expert
            accelerator_memory=24 * GB,
            # A desktop host: dual-channel DDR5-5600 is 89.6 GB/s nominal; multi-threaded
            # streaming reads reach about 60 GB/s. AVX2 bf16->fp32 FMA: ~0.8 TFLOP/s on 16 cores.
            cpu_bandwidth=60 * GB,
            cpu_flops=0.8e12,
            cpu_expert_time=20e-6,  # thread-pool dispatch and join per expert
            cpu_threads=16,
            note="RTX 4090 24 GB on PCIe 4.0 x16 (25 of 32 GB/s), desktop DDR5 host",
        ),
        HardwareProfile(
            name="a100-pcie4",
            link_bandwidth=PCIE4_EFFECTIVE,
            link_latency=PCIE_COPY_LATENCY,
            # A100-80GB HBM2e is 1935-2039 GB/s nominal; ~80% for grouped expert GEMVs.
            accelerator_bandwidth=1600 * GB,
            accelerator_flops=250e12,  # bf16 dense, 312 TFLOP/s nominal
            accelerator_expert_time=5e-6,
            accelerator_memory=80 * GB,
            # A server host socket: 8-channel DDR4-3200 is 204.8 GB/s nominal; ~120 GB/s reached.
            cpu_bandwidth=120 * GB,
            cpu_flops=1.5e12,
            cpu_expert_time=20e-6,
            cpu_threads=32,
            note="A100-80GB on PCIe 4.0 x16 (25 of 32 GB/s), 8-channel DDR4 server socket",
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
    missing = sorted(names - set(data) - {"note"})
    if missing:
        raise ValueError(f"{path}: profile lacks {', '.join(missing)}")
    return HardwareProfile(**{k: v for k, v in data.items() if k in names})


def _best_time(fn, repeats: int) -> float:
    fn()  # warm caches and lazy initialisation
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_this_machine(
    hidden_size: int = 2048, intermediate_size: int = 768, repeats: int = 5
) -> HardwareProfile:
    """A CPU-only profile measured here: both tiers are this CPU, the link is a memory copy.

    link_bandwidth: a 64 MiB tensor copied into another (bytes of the expert store moved per
    second, the copy a CPU engine does between its host store and its "device" cache);
    cpu/accelerator bandwidth: one SwiGLU expert of the given size applied to one token
    (three matvecs), weight bytes over the best time; fixed time: the same expert at 1/16 of the
    size, what does not shrink with the bytes; FLOP rate: the extra time of 16 tokens over 1.
    The expert is float32: torch's CPU bf16 matvec paths vary by shape by up to 100x, and a
    bandwidth is bytes read per second whatever their type. Both tiers share one memory bus
    here, which the timing model does not know: the profile is for relative comparisons.
    """
    import torch

    threads = torch.get_num_threads()
    source = torch.empty(64 << 20, dtype=torch.uint8)
    target = torch.empty_like(source)
    copy_time = _best_time(lambda: target.copy_(source), repeats)
    link_bandwidth = source.numel() / copy_time

    def expert_time(h: int, i: int, tokens: int = 1) -> tuple[float, int]:
        w1 = torch.randn(i, h)
        w3 = torch.randn(i, h)
        w2 = torch.randn(h, i)
        x = torch.randn(tokens, h)

        def run():
            y = torch.nn.functional.silu(x @ w1.T) * (x @ w3.T)
            return y @ w2.T

        return _best_time(run, repeats), 3 * h * i * 4

    seconds, nbytes = expert_time(hidden_size, intermediate_size)
    small_seconds, small_bytes = expert_time(hidden_size // 4, intermediate_size // 4)
    # Two points on t = fixed + bytes / bandwidth.
    bandwidth = (nbytes - small_bytes) / max(seconds - small_seconds, 1e-9)
    fixed = max(small_seconds - small_bytes / bandwidth, 0.0)
    # The FLOP rate from the extra time of 16 tokens over 1 (2 FLOP per weight per token).
    batch_seconds, _ = expert_time(hidden_size, intermediate_size, tokens=16)
    flops = 2 * (nbytes / 4) * 15 / max(batch_seconds - seconds, 1e-9)
    return HardwareProfile(
        name=THIS_MACHINE,
        link_bandwidth=link_bandwidth,
        link_latency=0.0,
        accelerator_bandwidth=bandwidth,
        accelerator_flops=flops,
        accelerator_expert_time=fixed,
        accelerator_memory=0.0,
        cpu_bandwidth=bandwidth,
        cpu_flops=flops,
        cpu_expert_time=fixed,
        cpu_threads=threads,
        note=f"measured with torch {torch.__version__} on {threads} threads",
    )
