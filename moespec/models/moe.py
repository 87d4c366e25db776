"""The MoE block: router -> (weights, ids) -> expert kernel -> combine.

T = tokens of the pass (batch flattened), H = hidden, E = experts, m = experts per token.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moespec.kernels import ExpertWeights, get_kernel
from moespec.kernels.linear import linear

# sink(layer, expert_ids [T, m], expert_weights [T, m]): sees the routing of every pass.
RoutingSink = Callable[[int, torch.Tensor, torch.Tensor], None]
# offload(layer, x [T, H], expert_ids [T, m], expert_weights [T, m], kernel) -> y [T, H]: runs a
# layer's experts from tiers of its own (moespec.offload's executor) instead of the block's.
ExpertExecutor = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, str], torch.Tensor]


def route(
    x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts (in float32), keep the top k, optionally renormalise them.

    Qwen3-MoE and OLMoE renormalise when `norm_topk_prob`; Mixtral always does (top-k of the
    logits then softmax is the same thing). Returns (weights [T, m] float32, ids [T, m]).
    """
    logits = linear(x, router)  # [T, E]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@dataclass
class MoEBlock:
    router: torch.Tensor  # [E, H]
    experts: ExpertWeights
    top_k: int
    renormalize: bool

    def __call__(
        self,
        x,
        *,
        kernel: str,
        layer: int,
        sink: RoutingSink | None = None,
        offload: ExpertExecutor | None = None,
    ):
        # x: [B, T, H]
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids = route(flat, self.router, self.top_k, self.renormalize)
        if sink is not None:
            sink(layer, ids, weights)
        if offload is not None:  # the experts live in the executor's tiers, not in self.experts
            return offload(layer, flat, ids, weights, kernel).view(shape)
        return get_kernel(kernel)(flat, ids, weights, self.experts).view(shape)
