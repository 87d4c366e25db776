"""Expert kernels: one signature, several implementations.

    kernel(x, expert_ids, expert_weights, experts) -> y

x: [T, H] the pass's token activations; expert_ids: [T, m] the experts each token selects;
expert_weights: [T, m] their routing weights; experts: the layer's stacked expert weights.
The pipeline inside each kernel is the same: (gate, up) -> SwiGLU -> down -> weighted combine.

- "reference": a plain loop over (token, slot), for tests only.
- "slot": per-slot; one matrix-vector product per (token, slot): n m expert reads per pass.
- "dedup": deduplicating; the pass's slots grouped by expert, each distinct expert read once and
  applied to all of its tokens as a small matrix. The fastest variant for the weights' dtype.
- "dedup-linear": deduplicating with plain `F.linear` on every dtype (in fp32, the default BLAS
  path for 2-9 rows moves its bytes at a lower bandwidth; kept for calibrations that need a
  kernel pair with a real crossover).

On a CUDA device with Triton installed, "slot" and "dedup" run Triton kernels of the same names
(`moespec.kernels.triton`); elsewhere, and for passes those do not take, the torch ones.
"""

from moespec.kernels.dedup import dedup_experts, dedup_linear_experts
from moespec.kernels.experts import ExpertWeights
from moespec.kernels.reference import reference_experts
from moespec.kernels.slot import slot_experts
from moespec.kernels.triton import cuda_first

KERNELS = {
    "reference": reference_experts,
    "slot": cuda_first("slot", slot_experts),
    "dedup": cuda_first("dedup", dedup_experts),
    "dedup-linear": dedup_linear_experts,
}

__all__ = [
    "KERNELS",
    "ExpertWeights",
    "dedup_experts",
    "dedup_linear_experts",
    "get_kernel",
    "reference_experts",
    "slot_experts",
]


def get_kernel(name: str):
    try:
        return KERNELS[name]
    except KeyError:
        raise ValueError(
            f"unknown expert kernel {name!r}; choose one of {sorted(KERNELS)}"
        ) from None
