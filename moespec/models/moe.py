"""The MoE block: router -> (weights, ids) -> expert kernel -> combine (+ shared experts).

T = tokens of the pass (batch flattened), H = hidden, E = experts, m = experts per token,
G = expert groups.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moespec.kernels import ExpertWeights, get_kernel
from moespec.kernels.linear import linear, pack
from moespec.models.config import GroupRouting, RouterScoring
from moespec.models.layers import DenseMLP

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
    router_bias: torch.Tensor | None = None,
    scoring: RouterScoring = "softmax",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts (in float32), keep the top k, optionally renormalise them.

    Qwen3-MoE and OLMoE renormalise when `norm_topk_prob`; Mixtral always does (top-k of the
    logits then softmax is the same thing). "softmax_topk": the top k logits, softmax over
    those alone (gpt-oss, whose router adds `router_bias` to its logits).
    Returns (weights [T, m] float32, ids [T, m]).
    """
    logits = linear(x, router, router_bias)  # [T, E]
    if scoring == "softmax_topk":
        top, ids = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=torch.float32), ids
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_groups(
    x: torch.Tensor,
    router: torch.Tensor,
    top_k: int,
    renormalize: bool,
    routing: GroupRouting,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-limited top-k (DeepSeek-V2 §2.2.2, GLM-4.5), computed in float32 as
    transformers' DeepseekV2TopkRouter and Glm4MoeTopkRouter do: the scores s (softmax or
    sigmoid of the logits), plus the correction bias for choosing only; the top groups by
    their best (or two best) scores; the top k experts within them; weights s of those,
    renormalised if asked, times the routed scaling factor. MiniMax-M2's router is the
    sigmoid one with a single group. Returns (weights, ids) [T, m]."""
    logits = linear(x.float(), router)  # [T, E]
    scores = logits.softmax(dim=-1) if routing.scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias
    if routing.top_groups < routing.groups:
        grouped = choice.view(choice.shape[0], routing.groups, -1)  # [T, G, E / G]
        if routing.group_score == "max":
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        kept = torch.topk(group_scores, routing.top_groups, dim=-1).indices  # [T, top groups]
        dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, kept, False)
        choice = grouped.masked_fill(dropped[..., None], float("-inf")).view_as(choice)
    ids = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.scale, ids


@dataclass
class MoEBlock:
    router: torch.Tensor  # [E, H]
    experts: ExpertWeights
    top_k: int
    renormalize: bool
    routing: GroupRouting | None = None  # None: `route` (softmax over all experts, top-k)
    correction_bias: torch.Tensor | None = None  # [E], float32 (sigmoid routers)
    router_bias: torch.Tensor | None = None  # [E], added to the logits (gpt-oss)
    shared: DenseMLP | None = None  # shared experts: every token, beside its routed ones
    # [1, H]: the shared experts' output times sigmoid(shared_gate x) per token (Qwen3.5)
    shared_gate: torch.Tensor | None = None

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, ids) [T, m] of the routed experts of flat [T, H]."""
        r = self.routing
        if r is None or r.scoring == "softmax_topk":
            scoring = "softmax" if r is None else r.scoring
            return route(flat, self.router, self.top_k, self.renormalize, self.router_bias, scoring)
        return route_groups(
            flat, self.router, self.top_k, self.renormalize, self.routing, self.correction_bias
        )

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
        weights, ids = self.route(flat)
        if sink is not None:  # the routed experts only: shared ones are dense bytes
            sink(layer, ids, weights)
        if offload is not None:  # the experts live in the executor's tiers, not in self.experts
            y = offload(layer, flat, ids, weights, kernel).view(shape)
        else:
            y = get_kernel(kernel)(flat, ids, weights, self.experts).view(shape)
        if self.shared is not None:
            y = y + self._shared(x)
        return y

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        if self.shared_gate is None:
            return self.shared(x)
        return torch.sigmoid(linear(x, self.shared_gate)) * self.shared(x)

    def dense_tensors(self) -> list:
        """The weights a pass reads once whatever the routing: router, biases, shared experts."""
        biases = [t for t in (self.router_bias, self.correction_bias) if t is not None]
        return [self.router, *biases, *self.shared_tensors()]

    def shared_tensors(self) -> list:
        """The shared experts' weights with their gate (dense bytes, never routed)."""
        if self.shared is None:
            return []
        gate = [] if self.shared_gate is None else [self.shared_gate]
        return [*self.shared.tensors(), *gate]

    def products(self) -> list:
        """Weights of the block's products beside the experts' (for thread reports)."""
        if self.shared is None:
            return []
        gate = [] if self.shared_gate is None else [self.shared_gate]
        return [*self.shared.products(), *gate]

    def pack(self, experts: bool = True) -> None:
        self.router = pack(self.router)
        if experts:
            self.experts.pack()
        if self.shared is not None:
            self.shared.pack()
