"""The per-slot kernel: one matrix-vector product per (token, slot).

A pass of n tokens reads n m experts, repeated experts included (seed 000 §1). Products read the
stacked weights in place (`gate_up[e]` is a view); no gathered copy of the weights is made.
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
    num_tokens, top_k = expert_ids.shape
    inter = experts.intermediate_size
    gate_up, down = experts.gate_up, experts.down
    ids = expert_ids.tolist()
    hidden = x.new_empty(top_k, 2 * inter)  # [m, 2I]: one token's slots
    outputs = x.new_empty(top_k, x.shape[1])  # [m, H]
    y = torch.empty_like(x)
    weights = expert_weights.to(x.dtype)
    for t in range(num_tokens):
        for s, e in enumerate(ids[t]):
            torch.mv(gate_up[e], x[t], out=hidden[s])
        act = F.silu(hidden[:, :inter]) * hidden[:, inter:]  # [m, I]
        for s, e in enumerate(ids[t]):
            torch.mv(down[e], act[s], out=outputs[s])
        torch.mv(outputs.T, weights[t], out=y[t])  # combine: sum_s w[t, s] outputs[s]
    return y
