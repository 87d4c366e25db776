"""The per-slot kernel: one matrix-vector product per (token, slot).

A pass of n tokens reads n m experts, repeated experts included (seed 000 §1). Products read the
stacked weights in place (`gate_up[e]` is a view); no gathered copy of the weights is made.
Each product is `F.linear` on a one-row matrix: on CPU its bf16 path moves about twice the
bytes per second of `torch.mv`'s.
"""

import torch
import torch.nn.functional as F

from moespec.kernels.experts import ExpertWeights


def slot_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    experts: ExpertWeights,
) -> torch.Tensor:
    # x: [T, H]; expert_ids, expert_weights: [T, m]
    inter = experts.intermediate_size
    gate_up, down = experts.gate_up, experts.down
    weights = expert_weights.to(x.dtype)
    y = torch.empty_like(x)
    for t, row in enumerate(expert_ids.tolist()):
        token = x[t : t + 1]  # [1, H]
        hidden = torch.cat([F.linear(token, gate_up[e]) for e in row])  # [m, 2I]
        act = F.silu(hidden[:, :inter]) * hidden[:, inter:]  # [m, I]
        out = torch.cat([F.linear(act[s : s + 1], down[e]) for s, e in enumerate(row)])  # [m, H]
        y[t] = weights[t] @ out  # combine: sum_s w[t, s] out[s]
    return y
