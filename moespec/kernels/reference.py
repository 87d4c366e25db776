"""The plain reference expert operation: a loop over tokens and slots, for tests."""

import torch
import torch.nn.functional as F

from moespec.kernels.experts import ExpertWeights


def reference_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    experts: ExpertWeights,
) -> torch.Tensor:
    """y[t] = sum_s w[t, s] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])), e = ids[t, s]."""
    inter = experts.intermediate_size
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for s in range(expert_ids.shape[1]):
            gate_up, down = experts.dense_weights(int(expert_ids[t, s]))
            gate = gate_up[:inter] @ x[t]
            up = gate_up[inter:] @ x[t]
            out = down @ (F.silu(gate) * up)
            y[t] += (out.float() * expert_weights[t, s].float()).to(x.dtype)
    return y
