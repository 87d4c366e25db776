"""The MoE block: router -> (weights, ids) -> expert kernel -> combine.

T = tokens of the pass (batch flattened), H = hidden, E = experts, m = experts per token.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moespec.kernels import ExpertWeights, get_kernel
from moespec.kernels.linear import linear
from moespec.models.config import Scoring

# sink(layer, expert_ids [T, m], expert_weights [T, m]): sees the routing of every pass.
RoutingSink = Callable[[int, torch.Tensor, torch.Tensor], None]
# offload(layer, x [T, H], expert_ids [T, m], expert_weights [T, m], kernel) -> y [T, H]: runs a
# layer's experts from tiers of its own (moespec.offload's executor) instead of the block's.
ExpertExecutor = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, str], torch.Tensor]


def route(
    x: torch.Tensor,
    router: torch.Tensor,
    top_k: int,
    renormalize: bool,
    *,
    scoring: Scoring = "softmax",
    router_bias: torch.Tensor | None = None,
    selection_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice of m experts per token and their weights, in float32.

    "softmax": softmax over all experts, keep the top k, renormalised when `renormalize`
    (Qwen3-MoE and OLMoE when `norm_topk_prob`; Mixtral always: top-k of the logits then
    softmax is the same thing). "softmax_topk": the top k logits, softmax over those alone
    (gpt-oss, whose router adds `router_bias` to its logits). "sigmoid": sigmoid scores, the
    top k of scores + `selection_bias` chosen (MiniMax-M2's score-correction bias), weighted
    by their scores, renormalised when `renormalize`. Returns (weights [T, m], ids [T, m]).
    """
    logits = linear(x, router, router_bias)  # [T, E]
    if scoring == "softmax_topk":
        top, ids = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=torch.float32), ids
    if scoring == "sigmoid":
        scores = torch.sigmoid(logits.float())
        choice = scores if selection_bias is None else scores + selection_bias
        ids = torch.topk(choice, top_k, dim=-1).indices
        weights = scores.gather(1, ids)
    else:
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
    scoring: Scoring = "softmax"
    router_bias: torch.Tensor | None = None  # [E], added to the logits (gpt-oss)
    selection_bias: torch.Tensor | None = None  # [E], added to the scores to choose (MiniMax-M2)

    def dense_tensors(self) -> list[torch.Tensor]:
        """The block's tensors that every pass reads once, whatever the routing."""
        return [t for t in (self.router, self.router_bias, self.selection_bias) if t is not None]

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
        weights, ids = route(
            flat,
            self.router,
            self.top_k,
            self.renormalize,
            scoring=self.scoring,
            router_bias=self.router_bias,
            selection_bias=self.selection_bias,
        )
        if sink is not None:
            sink(layer, ids, weights)
        if offload is not None:  # the experts live in the executor's tiers, not in self.experts
            return offload(layer, flat, ids, weights, kernel).view(shape)
        return get_kernel(kernel)(flat, ids, weights, self.experts).view(shape)
