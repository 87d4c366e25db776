"""The CPU's instruction-set facts: its flags and its family, as PyTorch's dispatch lowers them.

Kept apart from `moespec.kernels.cpu` (which chooses the product paths from these facts and
from what `moespec.kernels.native` built) so that the native loops can ask for them too.
"""

import functools
from pathlib import Path

FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "amx_bf16",
    "amx_int8",
)


def cpu_flags(cpuinfo: str | None = None) -> tuple[str, ...]:
    """The FLAGS the first processor of /proc/cpuinfo lists (none where it is unreadable)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return ()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            present = set(line.split(":", 1)[1].split())
            return tuple(f for f in FLAGS if f in present)
    return ()


def cpu_family(capability: str, flags: tuple[str, ...]) -> str:
    """amx, avx512-bf16, avx512, avx2 or other: the flags, as lowered by PyTorch's dispatch
    level (ATEN_CPU_CAPABILITY=avx2 reads as avx2)."""
    if capability not in ("AVX512", "AVX512_BF16", "AMX") or "avx512f" not in flags:
        return "avx2" if "avx2" in flags else "other"
    if "amx_bf16" in flags:
        return "amx"
    return "avx512-bf16" if "avx512_bf16" in flags else "avx512"


@functools.cache
def this_cpu() -> tuple[str, tuple[str, ...], str]:
    """(PyTorch's dispatch level, the FLAGS /proc/cpuinfo lists, the family) of this process."""
    from moespec.provenance import cpu_capability  # the one reading of it

    capability, flags = cpu_capability() or "unknown", cpu_flags()
    return capability, flags, cpu_family(capability, flags)
