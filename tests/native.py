"""Skips for the tests of the native paths, with the machine's own reasons and no others.

`moespec env` reports whether the native loops and the native model pass run here
(`moespec.kernels.cpu.native_pass_reason`), the machine's reasons first: the library turned
off, not x86-64, no C compiler (`moespec.kernels.native.unavailable_here`), a CPU family
without the loops (`family_lacks`). A test skips on those alone. Where the machine has what a
native path needs, a build that failed, a function the build lacks or a pass that declines is
a failure of the test, with its reason: the tests cannot pass by skipping.
"""

import pytest

from moespec.kernels.cpu import cpu_paths, native_pass_lacks, native_pass_reason
from moespec.kernels.isa import cpu_flags, this_cpu
from moespec.kernels.native import (
    ATTENTION,
    family_lacks,
    layout_function,
    native,
    unavailable_here,
)


def needs_library() -> None:
    """Skip where this machine builds no native library; else the library must be there."""
    if (why := unavailable_here()) is not None:
        pytest.skip(f"no native library on this machine: {why}")
    assert native().lib is not None, f"the native library should build here: {native().reason}"


def needs_loops(kind: str, family: str | None = None) -> str:
    """The native function for "bf16" or "int8" weights on CPU `family` (this CPU's), skipping
    only where the machine lacks them."""
    family = family or this_cpu()[2]
    if (why := unavailable_here() or family_lacks(kind, family)) is not None:
        pytest.skip(f"no native {kind} loops for {family} on this machine: {why}")
    name, why = layout_function(kind, family)
    assert name is not None, f"the native {kind} loops should run here: {why}"
    return name


def needs_function(function: str, flags) -> None:
    """Skip where the CPU lacks `flags` or the machine builds no library; else the build must
    hold `function`."""
    if missing := set(flags) - set(cpu_flags()):
        pytest.skip(f"{function} needs {', '.join(sorted(missing))}, which this CPU lacks")
    needs_library()
    assert native().has(function), f"the {native().compiler} build lacks {function}"


def needs_attention(family: str | None = None) -> str:
    """The native attention of CPU `family` (this CPU's), skipping only where the machine
    lacks it."""
    family = family or this_cpu()[2]
    if (why := unavailable_here() or family_lacks("attention", family)) is not None:
        pytest.skip(f"no native {family} attention on this machine: {why}")
    assert native().has(ATTENTION[family]), f"the {native().compiler} build lacks it"
    return ATTENTION[family]


def needs_native_pass(family: str | None = None) -> None:
    """Skip where this machine cannot run the native model pass (the reason `moespec env`
    gives); else env must say that it runs."""
    if (why := native_pass_lacks(family)) is not None:
        pytest.skip(f"no native pass on this machine: {why}")
    assert (why := native_pass_reason(family)) is None, f"the native pass should run here: {why}"
    assert cpu_paths().to_dict()["native_pass"] == "available"  # what `moespec env` says


# The families the native pass takes, each for what it exercises: qwen3_moe, q/k norms per
# head, an untied head, a dense layer among MoE ones; qwen3, dense and tied; mixtral, no q/k
# norm and renormalised top-k; olmoe, norms over the whole projection (its tiny checkpoint
# clips q, k and v, which the native pass does not take: without clipping here)
NATIVE_FAMILIES = {"qwen3_moe": {}, "qwen3": {}, "mixtral": {}, "olmoe": {"clip_qkv": None}}


def native_checkpoints(tmp_path_factory):
    """make(family) -> a tiny checkpoint directory of that family, written once."""
    from tests.checkpoints import hf_model, save_checkpoint

    made = {}

    def make(family):
        if family not in made:
            model = hf_model(family, **NATIVE_FAMILIES.get(family, {}))
            made[family] = save_checkpoint(model, tmp_path_factory.mktemp(family))
        return made[family]

    return make


def native_model(directory, **kwargs):
    """The checkpoint in bf16, its passes native: skipped only where this machine cannot run
    the native pass, a failure where it can and the pass declines the model."""
    from moespec.models import load_model

    needs_native_pass()
    model = load_model(directory, dtype="bf16", **kwargs)[0]
    assert model.native_report() == {"native": True, "note": None}
    return model
