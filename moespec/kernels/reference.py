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
    """y[t] = sum_s w[t, s] * (down[e] @ act(gate[e] @ x[t] + b_g, up[e] @ x[t] + b_u) + b_d),
    e = ids[t, s]: act(g, u) = silu(g) * u (SwiGLU), or for a ClampedSwiGLU (gpt-oss)
    (clamp(u, -l, l) + 1) * g' * sigmoid(alpha g') with g' = min(g, l). Biases are 0 if absent."""
    inter = experts.intermediate_size
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for s in range(expert_ids.shape[1]):
            e = int(expert_ids[t, s])
            gate_up, down = experts.dense_weights(e)
            gate = gate_up[:inter] @ x[t]
            up = gate_up[inter:] @ x[t]
            if experts.has_bias:
                gate = gate + experts.gate_up_bias[e, :inter]
                up = up + experts.gate_up_bias[e, inter:]
            clamp = experts.activation
            if clamp is None:
                act = F.silu(gate) * up
            else:
                gate, up = gate.clamp(max=clamp.limit), up.clamp(-clamp.limit, clamp.limit)
                act = (up + 1) * gate * torch.sigmoid(clamp.alpha * gate)
            out = down @ act
            if experts.has_bias:
                out = out + experts.down_bias[e]
            y[t] += (out.float() * expert_weights[t, s].float()).to(x.dtype)
    return y
