"""The shared body of the CPU expert kernels: products of row groups with their experts' weights.

A kernel lays the pass's slots out as rows (each row a token's activation) in groups that share
one expert; every group is two products (gate/up, then down) on that expert's weights, and
everything else — gathering rows, SwiGLU, weighting, combining — runs once for the whole pass,
so per-expert work is only the two products. The per-slot kernel makes one group per slot;
the deduplicating kernel one group per distinct expert.
"""

import torch

from moespec.kernels.experts import ExpertWeights
from moespec.kernels.linear import linear, linear_batch


def grouped_products(
    x: torch.Tensor, rows: torch.Tensor, groups: list[tuple[int, int, int]], experts: ExpertWeights
) -> torch.Tensor:
    """out[r] = down_e @ act(gate_up_e @ x[rows[r]]) for each group (e, start, stop) of rows
    (act: ExpertWeights.activate; the experts' biases added where they have them).

    x: [T, H]; rows: [R] token of each row; returns [R, H].
    """
    xs = x.index_select(0, rows)  # [R, H]
    weights = [experts.weights(e) for e, _, _ in groups]
    starts, counts = [a for _, a, _ in groups], [b - a for _, a, b in groups]
    # one native call for every group's product where the weights take it (one per group else)
    total = len(rows)
    hidden = linear_batch(xs, [g for g, _ in weights], starts, counts, starts, total)
    if hidden is None:
        hidden = torch.cat(
            [
                linear(xs[a:b], gate_up)
                for (_, a, b), (gate_up, _) in zip(groups, weights, strict=True)
            ]
        )  # [R, 2I]
    if experts.has_bias:
        row_experts = torch.tensor([e for e, a, b in groups for _ in range(b - a)])  # [R]
        hidden = hidden + experts.gate_up_bias[row_experts]
    act = experts.activate(hidden)  # [R, I]
    out = linear_batch(act, [d for _, d in weights], starts, counts, starts, total)
    if out is None:
        out = torch.cat(
            [linear(act[a:b], down) for (_, a, b), (_, down) in zip(groups, weights, strict=True)]
        )  # [R, H]
    return out + experts.down_bias[row_experts] if experts.has_bias else out
