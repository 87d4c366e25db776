"""Mixtral (`mixtral`): plain attention (optional sliding window); top-k of the router's
softmax, always renormalised; experts named w1 (gate), w3 (up), w2 (down) under
`block_sparse_moe`."""

from moespec.models.checkpoint import WeightLayout
from moespec.models.config import ModelConfig, common_fields, optional, require

LAYOUT = WeightLayout(moe_prefix="block_sparse_moe", expert_projections=("w1", "w3", "w2"))


def parse_config(raw: dict) -> ModelConfig:
    window = optional(raw, "sliding_window")
    return ModelConfig(
        **common_fields(raw),
        sliding_window=int(window) if window is not None else None,
        num_experts=int(require(raw, "num_local_experts", "num_experts")),
        top_k=int(require(raw, "num_experts_per_tok")),
        moe_intermediate_size=int(require(raw, "intermediate_size")),
        norm_topk_prob=True,
    )
