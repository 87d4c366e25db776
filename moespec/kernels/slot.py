"""The per-slot kernel: one matrix-vector product per (token, slot).

A pass of n tokens reads n m experts, repeated experts included (seed 000 §1). Products read
each expert's own weights in place (a view, or its packed layout); no gathered copy is made.
"""

import torch

from moespec.kernels.experts import ExpertWeights
from moespec.kernels.grouped import grouped_products


def slot_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    experts: ExpertWeights,
) -> torch.Tensor:
    # x: [T, H]; expert_ids, expert_weights: [T, m]
    tokens, top_k = expert_ids.shape
    ids = expert_ids.flatten().tolist()  # slot-major: token t's slots are rows t m .. t m + m - 1
    groups = [(e, r, r + 1) for r, e in enumerate(ids)]
    rows = torch.arange(tokens).repeat_interleave(top_k)
    out = grouped_products(x, rows, groups, experts).view(tokens, top_k, -1)  # [T, m, H]
    return (out * expert_weights.to(x.dtype).unsqueeze(-1)).sum(dim=1)
