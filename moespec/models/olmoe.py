"""OLMoE (`olmoe`): RMSNorm over the whole q and k projections, optional clipping of q, k, v;
softmax router, top-k, renormalised when `norm_topk_prob` (off in OLMoE-1B-7B)."""

from moespec.models.checkpoint import WeightLayout
from moespec.models.config import ModelConfig, common_fields, optional, require

LAYOUT = WeightLayout()


def parse_config(raw: dict) -> ModelConfig:
    clip = optional(raw, "clip_qkv")
    return ModelConfig(
        **common_fields(raw),
        qk_norm="projection",
        clip_qkv=float(clip) if clip is not None else None,
        num_experts=int(require(raw, "num_experts", "num_local_experts")),
        top_k=int(require(raw, "num_experts_per_tok")),
        moe_intermediate_size=int(require(raw, "intermediate_size")),
        norm_topk_prob=bool(optional(raw, "norm_topk_prob", default=False)),
    )
