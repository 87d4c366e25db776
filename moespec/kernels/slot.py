"""The per-slot kernel: one matrix-vector product per (token, slot).

A pass of n tokens reads n m experts, repeated experts included (seed 000 §1). Products read
each expert's own weights in place (a view, or its packed layout); no gathered copy is made.
Each slot's row is its token's row of x itself (no gather): a one-token decode pass costs
the 2 m products plus a fixed handful of operations, whatever the number of experts.
"""

import torch

from moespec.kernels.experts import ExpertWeights
from moespec.kernels.invariance import is_batch_invariant
from moespec.kernels.linear import linear, linear_batch


def slot_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    experts: ExpertWeights,
) -> torch.Tensor:
    # x: [T, H]; expert_ids, expert_weights: [T, m]
    tokens, top_k = expert_ids.shape
    if expert_ids.numel() == 0:  # no slots: nothing to multiply (torch.cat refuses none)
        return torch.zeros_like(x)
    # slot-major: token t's slots are rows t m .. t m + m - 1
    pairs = [experts.weights(e) for row in expert_ids.tolist() for e in row]
    rows_of_slots, ones = range(len(pairs)), [1] * len(pairs)
    # one native call for every slot's product where the weights take it (one per slot else)
    hidden = linear_batch(
        x,
        [g for g, _ in pairs],
        [r // top_k for r in rows_of_slots],
        ones,
        rows_of_slots,
        len(pairs),
    )
    if hidden is None:
        rows = (x,) if tokens == 1 else x.split(1)
        hidden = torch.cat(
            [linear(rows[r // top_k], gate_up) for r, (gate_up, _) in enumerate(pairs)]
        )  # [T m, 2I]
    if experts.has_bias:
        slots = expert_ids.flatten()
        hidden = hidden + experts.gate_up_bias[slots]
    act = experts.activate(hidden)  # [T m, I]
    out = linear_batch(act, [d for _, d in pairs], rows_of_slots, ones, rows_of_slots, len(pairs))
    if out is None:
        out = torch.cat(
            [linear(a, down) for a, (_, down) in zip(act.split(1), pairs, strict=True)]
        )  # [T m, H]
    if experts.has_bias:
        out = out + experts.down_bias[slots]
    out = out * expert_weights.to(x.dtype).view(-1, 1)
    if tokens == 1 and not is_batch_invariant():
        return out.sum(dim=0, keepdim=True)
    return out.view(tokens, top_k, -1).sum(dim=1)  # the same sum for every pass size
