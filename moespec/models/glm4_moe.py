"""GLM-4.5 and GLM-4.5-Air (`glm4_moe`): grouped-query attention with q, k, v biases, RMSNorm
on each head's q and k when `use_qk_norm`, rope on the first `partial_rotary_factor` of each
head; a sigmoid router whose e_score_correction_bias steers the choice of experts (not their
weights), group-limited top-k (groups scored by their two best experts), weights renormalised
when `norm_topk_prob` and times the routed scaling factor; shared experts beside the routed
ones (DeepSeek-V2's MoE block); the first `first_k_dense_replace` layers dense. The
multi-token-prediction layers after the last decoder layer are not loaded (transformers
ignores them too)."""

from moespec.models.checkpoint import WeightLayout
from moespec.models.config import GroupRouting, ModelConfig, common_fields, optional, require

LAYOUT = WeightLayout()


def parse_config(raw: dict) -> ModelConfig:
    fields = common_fields(raw, partial_rotary=0.5)
    dense = int(optional(raw, "first_k_dense_replace", default=1))
    return ModelConfig(
        **fields,
        qk_norm="head" if raw.get("use_qk_norm") else "none",
        intermediate_size=int(optional(raw, "intermediate_size", default=0)),
        num_experts=int(require(raw, "n_routed_experts", "num_local_experts")),
        top_k=int(require(raw, "num_experts_per_tok")),
        moe_intermediate_size=int(require(raw, "moe_intermediate_size")),
        norm_topk_prob=bool(optional(raw, "norm_topk_prob", default=True)),
        moe_layers=tuple(i >= dense for i in range(fields["num_layers"])),
        routing=GroupRouting(
            scoring="sigmoid",
            groups=int(optional(raw, "n_group", default=1)),
            top_groups=int(optional(raw, "topk_group", default=1)),
            group_score="top2",
            scale=float(optional(raw, "routed_scaling_factor", default=1.0)),
            correction_bias=True,
        ),
        shared_experts=int(optional(raw, "n_shared_experts", default=1)),
    )
