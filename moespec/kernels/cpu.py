"""The CPU's capability, detected once, and the product path chosen for each weight format.

Four facts decide the path: PyTorch's kernel dispatch (`torch.backends.cpu.
get_cpu_capability()`: "AVX512", "AVX2", ...; `ATEN_CPU_CAPABILITY=avx2` lowers it), the CPU's
flags in /proc/cpuinfo (AVX2, FMA, AVX-512F/BW/VL, AVX-512-BF16, AMX), whether moespec's
native loops built here (`moespec.kernels.native`), and whether oneDNN takes a weight in its
blocked layout for this dtype at its instruction limit (`ONEDNN_MAX_CPU_ISA=AVX2` lowers it;
bf16 needs AVX-512 BW/VL or AVX-NE-CONVERT). The choice, per format:

- bf16: "native-pairs" (the pair layout; `vdpbf16ps` on AVX-512-BF16 and AMX hosts, FMA on
  AVX2) where the native loops run, except on AVX-512 without bf16, where oneDNN's packed
  product is 2-2.5x the AVX2 loops from 4 rows; else "onednn-packed" where oneDNN packs bf16;
  else "aten-linear", the library's unpacked `F.linear`;
- fp32: "onednn-packed" (weights from 1 MiB) where oneDNN packs fp32, else "aten-linear";
- int8: "native-int8-pairs" (int8 in the pair layout, int16 inputs; AVX-512-VNNI, AVX-512BW
  or AVX2) for bf16 activations where the native loops run, else "aten-int8pack-mm",
  PyTorch's weight-only int8 product (`torch._weight_int8pack_mm`, one scale per output
  channel).

Measured side by side by benchmarks/cpu_paths.py (under the forced AVX2 dispatch too).
"""

import functools
import os
from dataclasses import dataclass

import torch

from moespec.kernels.isa import FLAGS, cpu_family, cpu_flags, this_cpu
from moespec.kernels.native import (
    ATTENTION,
    INT8,
    PAIRS,
    attention_function,
    family_lacks,
    layout_function,
    native,
    unavailable_here,
)

# Devices whose weights take this CPU's layouts: the CPU, and the meta device of a converted
# model's skeleton (moespec.models.converted), whose layouts must be the CPU's to the byte.
HOST = ("cpu", "meta")

__all__ = ["FLAGS", "CpuPaths", "cpu_family", "cpu_flags", "cpu_paths", "weight_paths"]

PATH_REASONS = {
    "native-pairs": "moespec's native loops on weights in the pair layout",
    "onednn-packed": "oneDNN on weights packed once in its blocked layout",
    "aten-linear": "the library's unpacked F.linear",
    "aten-int8pack-mm": "torch._weight_int8pack_mm, int8 weights with one scale per output channel",
    "native-int8-pairs": "moespec's native loops on int8 weights in the pair layout, int16 inputs",
}


@dataclass(frozen=True)
class CpuPaths:
    """What this process runs its products with (see the module docstring)."""

    capability: str  # PyTorch's dispatch level
    flags: tuple[str, ...]  # of FLAGS, those the CPU reports
    onednn_max_isa: str | None  # the ONEDNN_MAX_CPU_ISA limit, if set
    onednn_bf16: bool  # oneDNN packs bf16 weights here
    onednn_fp32: bool
    native: str | None  # why the native loops do not run here (None: they do)
    native_bf16: str | None  # the native bf16 function chosen (moespec.kernels.native)
    native_int8: str | None
    bf16: str
    fp32: str
    int8: str
    native_attention: str | None = None  # the native one-row bf16 attention, if it runs
    native_pass: str | None = None  # why the native model pass does not run here (None: it does)

    @property
    def family(self) -> str:
        """The CPU family in one word (`cpu_family`)."""
        return cpu_family(self.capability, self.flags)

    def path(self, dtype: torch.dtype | str, activations: torch.dtype | str | None = None) -> str:
        """The product path of a weight format: a dtype, or "bf16", "fp32", "int8" (int8
        weights take the native loops with bf16 activations only; None: bf16)."""
        name = format_name(dtype)
        if name not in ("bf16", "fp32", "int8"):
            return "aten-linear"  # fp16 and others: the library's default path
        if name == "int8" and activations is not None and format_name(activations) != "bf16":
            return "aten-int8pack-mm"
        return getattr(self, name)

    def fallback(self, name: str) -> str | None:
        """Why a format runs on a slower path than this CPU family's best (None where not)."""
        if (
            name == "bf16"
            and self.bf16 == "onednn-packed"
            and self.family
            in (
                "amx",
                "avx512-bf16",
            )
        ):
            return f"native bf16 loops not used: {self.native}"
        if getattr(self, name, None) != "aten-linear":
            return None
        needs = "AVX-512 BW/VL or AVX-NE-CONVERT" if name == "bf16" else "its x86 kernels"
        limit = f"ONEDNN_MAX_CPU_ISA={self.onednn_max_isa}" if self.onednn_max_isa else "none"
        why = f"oneDNN does not pack {name} weights here: it needs {needs}, ISA limit {limit}"
        return why + (f"; native loops: {self.native}" if name == "bf16" and self.native else "")

    def to_dict(self) -> dict:
        return {
            "torch": torch.__version__,
            "capability": self.capability,
            "family": self.family,
            "flags": list(self.flags),
            "onednn_max_isa": self.onednn_max_isa,
            "native": self.native or "available",
            "native_pass": self.native_pass or "available",
            "native_functions": {
                "bf16": self.native_bf16,
                "int8": self.native_int8,
                "attention": self.native_attention,
                "pass": None if self.native_pass else "moespec_step",
            },
            "paths": {"bf16": self.bf16, "fp32": self.fp32, "int8": self.int8},
            "fallbacks": {n: self.fallback(n) for n in ("bf16", "fp32") if self.fallback(n)},
        }


def format_name(dtype: torch.dtype | str) -> str:
    """ "bf16", "fp32", or the name as given ("int8", "float16", ...)."""
    if isinstance(dtype, str):
        return dtype
    return {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(
        dtype, str(dtype).removeprefix("torch.")
    )


def weight_paths(
    expert_format: str | None, dense_format: str | torch.dtype, activations=None
) -> dict:
    """A run's weight formats (experts; the dense products: attention, dense MLPs, head) and
    the product path each takes here with those activations (the model's dtype), with the
    CPU facts behind the choice (for reports)."""
    paths = cpu_paths()
    return {
        "experts": expert_format,
        "dense": format_name(dense_format),
        "expert_path": paths.path(expert_format, activations) if expert_format else None,
        "dense_path": paths.path(dense_format, activations),
        "cpu": paths.to_dict(),
    }


def native_pass_lacks(family: str | None = None) -> str | None:
    """Why this machine, by its own facts, cannot run the native model pass
    (moespec.models.native_step) with the loops of CPU `family` (this CPU's): no library here
    (turned off, not x86-64, no C compiler), or a family without the bf16 pair loops or the
    attention. None where it can: a supported bf16 model that then runs eagerly is a fault, and
    the tests fail on it rather than skip."""
    family = family or this_cpu()[2]
    return unavailable_here() or family_lacks("bf16", family) or family_lacks("attention", family)


def native_pass_reason(family: str | None = None) -> str | None:
    """Why the native model pass does not run here whatever the model (`moespec env` reports
    it): the machine's reason (`native_pass_lacks`), else the build's (it failed, or lacks a
    function the pass calls). None: it runs every supported bf16 model's passes."""
    family = family or this_cpu()[2]
    if (why := native_pass_lacks(family)) is not None:
        return why
    name, why = layout_function("bf16", family)
    if name is None:
        return why
    for symbol in ("moespec_step", ATTENTION[family], ATTENTION[family] + "_rows"):
        if not native().has(symbol):
            return f"the {native().compiler} build lacks {symbol}"
    return None


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN takes a weight of this dtype in its blocked layout on this CPU (at its
    instruction limit): one small weight tried, as `moespec.kernels.linear.pack` does."""
    if not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 1)
    except RuntimeError:
        return False
    return True


@functools.cache
def cpu_paths() -> CpuPaths:
    """This process's capability and chosen paths, detected on the first call."""
    bf16, fp32 = onednn_packs(torch.bfloat16), onednn_packs(torch.float32)
    capability, flags, family = this_cpu()
    facts = dict(
        capability=capability,
        flags=flags,
        onednn_max_isa=os.environ.get("ONEDNN_MAX_CPU_ISA"),
    )

    pairs, why_not = layout_function("bf16", family)
    int8, why_not_int8 = layout_function("int8", family)
    # why the native loops do not run: the library's reason, or a function this CPU family
    # would take that the build lacks (a family with no loops of a kind is a choice, not a
    # fallback: AVX-512 without bf16 keeps oneDNN for bf16)
    reason = native().reason
    if reason is None and pairs is None and PAIRS.get(family):
        reason = why_not
    if reason is None and int8 is None and INT8.get(family):
        reason = why_not_int8
    return CpuPaths(
        **facts,
        onednn_bf16=bf16,
        onednn_fp32=fp32,
        native=reason,
        native_bf16=pairs,
        native_int8=int8,
        bf16="native-pairs" if pairs else "onednn-packed" if bf16 else "aten-linear",
        fp32="onednn-packed" if fp32 else "aten-linear",
        int8="native-int8-pairs" if int8 else "aten-int8pack-mm",
        native_attention=getattr(attention_function(), "__name__", None),
        native_pass=native_pass_reason(family),
    )
