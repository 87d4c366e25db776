"""The deduplicating kernel: slots grouped by expert, each distinct expert read once.

A pass of n tokens reads the union of its experts, X(n) <= n m (seed 000 §1). Each distinct
expert multiplies all of its tokens at once as a small matrix ([rows, H] @ [H, 2I]).
"""

import torch

from moespec.kernels.experts import ExpertWeights
from moespec.kernels.grouped import grouped_products
from moespec.kernels.invariance import is_batch_invariant


def group_by_expert(expert_ids: torch.Tensor) -> dict[int, list[tuple[int, int]]]:
    """{expert: [(token, slot), ...]} in order of first appearance."""
    groups: dict[int, list[tuple[int, int]]] = {}
    for t, row in enumerate(expert_ids.tolist()):
        for s, e in enumerate(row):
            groups.setdefault(e, []).append((t, s))
    return groups


def _dedup(x, expert_ids, expert_weights, experts):
    # x: [T, H]; expert_ids, expert_weights: [T, m]
    top_k = expert_ids.shape[1]
    if expert_ids.numel() == 0:  # no slots: nothing to multiply (an empty index is float)
        return torch.zeros_like(x)
    slots, groups = [], []  # slots ordered by expert; one group per distinct expert
    for e, members in group_by_expert(expert_ids).items():
        groups.append((e, len(slots), len(slots) + len(members)))
        slots += [t * top_k + s for t, s in members]
    order = torch.tensor(slots)
    rows = order // top_k  # the token of each row
    out = grouped_products(x, rows, groups, experts)  # [R, H]
    weights = expert_weights.to(x.dtype).flatten()[order]  # [R]
    if is_batch_invariant():  # each token's slots summed in slot order, as a pass of one
        slotted = torch.empty(len(slots), x.shape[1], dtype=x.dtype)
        slotted[order] = out * weights.unsqueeze(1)
        return slotted.view(-1, top_k, x.shape[1]).sum(dim=1)
    return torch.zeros_like(x).index_add_(0, rows, out * weights.unsqueeze(1))


def dedup_experts(x, expert_ids, expert_weights, experts: ExpertWeights) -> torch.Tensor:
    """Deduplicating, on each expert's weights as held (packed for the CPU's fast path when
    the model was packed at load)."""
    return _dedup(x, expert_ids, expert_weights, experts)


def dedup_linear_experts(x, expert_ids, expert_weights, experts: ExpertWeights) -> torch.Tensor:
    """Deduplicating with the library's default `F.linear` path on ordinary weights, whatever
    the dtype: in fp32 its 2-9 row products move their bytes at a lower bandwidth, which gives
    calibrations a kernel pair with a real crossover. Needs unpacked weights."""
    if experts.is_packed:
        raise ValueError("dedup-linear needs unpacked expert weights (load the model unpacked)")
    return _dedup(x, expert_ids, expert_weights, experts)
