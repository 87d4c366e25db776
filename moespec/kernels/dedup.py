"""The deduplicating kernel: slots grouped by expert, each distinct expert read once.

A pass of n tokens reads the union of its experts, X(n) <= n m (seed 000 §1). Each distinct
expert multiplies all of its tokens at once as a small matrix ([rows, H] @ [H, 2I]).
"""

import torch
import torch.nn.functional as F

from moespec.kernels.experts import ExpertWeights


def group_by_expert(expert_ids: torch.Tensor) -> dict[int, list[tuple[int, int]]]:
    """{expert: [(token, slot), ...]} in order of first appearance."""
    groups: dict[int, list[tuple[int, int]]] = {}
    for t, row in enumerate(expert_ids.tolist()):
        for s, e in enumerate(row):
            groups.setdefault(e, []).append((t, s))
    return groups


def _dedup(x, expert_ids, expert_weights, experts, linear):
    # x: [T, H]; expert_ids, expert_weights: [T, m]
    inter = experts.intermediate_size
    y = torch.zeros_like(x)
    weights = expert_weights.to(x.dtype)
    for e, slots in group_by_expert(expert_ids).items():
        tokens = [t for t, _ in slots]
        rows = torch.tensor(tokens)
        xs = x[rows]  # [r, H]
        hidden = linear(xs, experts, "gate_up", e)  # [r, 2I]
        act = F.silu(hidden[:, :inter]) * hidden[:, inter:]  # [r, I]
        out = linear(act, experts, "down", e)  # [r, H]
        out = out * weights[rows, torch.tensor([s for _, s in slots])].unsqueeze(1)
        y.index_add_(0, rows, out)
    return y


def _plain_linear(inputs, experts, name, e):
    return F.linear(inputs, getattr(experts, name)[e])


def dedup_linear_experts(x, expert_ids, expert_weights, experts: ExpertWeights) -> torch.Tensor:
    """Deduplicating with plain `F.linear` whatever the dtype."""
    return _dedup(x, expert_ids, expert_weights, experts, _plain_linear)


# Below this many weight bytes the call overhead of oneDNN (~30 us) outweighs its bandwidth.
PACKED_MIN_BYTES = 1 << 20


def _packed_linear(inputs, experts, name, e):
    """oneDNN-prepacked fp32 weights keep their bandwidth at 2-9 rows, where MKL's does not.

    One row (a matrix-vector product) and small experts stay on `F.linear`; each expert is
    packed on first use, so memory grows only with the experts a run touches.
    """
    weight = getattr(experts, name)[e]
    if inputs.shape[0] == 1 or weight.nbytes < PACKED_MIN_BYTES:
        return F.linear(inputs, weight)
    packed = experts.packed.setdefault(name, {})
    if e not in packed:
        packed[e] = weight.to_mkldnn()
    return torch._C._nn.mkldnn_linear(inputs.to_mkldnn(), packed[e], None).to_dense()


def dedup_experts(x, expert_ids, expert_weights, experts: ExpertWeights) -> torch.Tensor:
    """Deduplicating, on the fastest path for the dtype (oneDNN prepacked in fp32 on CPU)."""
    linear = _plain_linear
    if x.dtype == torch.float32 and x.device.type == "cpu" and torch.backends.mkldnn.is_available():
        linear = _packed_linear
    return _dedup(x, expert_ids, expert_weights, experts, linear)
