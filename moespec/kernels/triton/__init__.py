"""Triton expert kernels for CUDA, used by "slot" and "dedup" when they can run.

Importing this package never imports Triton: the kernels load on the first pass that can use
them, i.e. when Triton is installed, CUDA is available, the tensors are on a CUDA device, the
activations and weights share a supported dtype and the pass has at most MAX_TOKENS tokens
(a verification pass; longer passes such as prompts keep the torch kernels).
"""

import functools
import importlib.util

import torch

MAX_TOKENS = 16
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.cache
def available() -> bool:
    """Triton is installed and a CUDA device is present."""
    return importlib.util.find_spec("triton") is not None and torch.cuda.is_available()


def fits(x: torch.Tensor, expert_ids: torch.Tensor, experts) -> bool:
    """Whether the Triton kernels take this pass, wherever its tensors are."""
    return (
        experts.is_plain_swiglu  # the Triton kernels compute the plain, unbiased SwiGLU
        and experts.gate_up.device == x.device
        and x.dtype == experts.dtype
        and x.dtype in DTYPES
        and expert_ids.shape[0] <= MAX_TOKENS
        and experts.gate_up.stride(-1) == 1
        and experts.down.stride(-1) == 1
    )


def usable(x: torch.Tensor, expert_ids: torch.Tensor, experts) -> bool:
    """Whether this pass runs on the Triton kernels (else the torch kernel runs it)."""
    return x.is_cuda and available() and fits(x, expert_ids, experts)


def slot_experts_triton(x, expert_ids, expert_weights, experts, settings=None):
    """Per-slot expert kernel in Triton (see `launch.slot_experts_triton`)."""
    from moespec.kernels.triton import launch

    return launch.slot_experts_triton(x, expert_ids, expert_weights, experts, settings)


def dedup_experts_triton(x, expert_ids, expert_weights, experts, settings=None):
    """Deduplicating expert kernel in Triton (see `launch.dedup_experts_triton`)."""
    from moespec.kernels.triton import launch

    return launch.dedup_experts_triton(x, expert_ids, expert_weights, experts, settings)


KERNELS = {"slot": slot_experts_triton, "dedup": dedup_experts_triton}


def cuda_first(name: str, fallback):
    """The kernel `name`: on Triton where `usable`, else `fallback` (the torch kernel)."""

    @functools.wraps(fallback)
    def kernel(x, expert_ids, expert_weights, experts):
        if usable(x, expert_ids, experts):
            return KERNELS[name](x, expert_ids, expert_weights, experts)
        return fallback(x, expert_ids, expert_weights, experts)

    return kernel
