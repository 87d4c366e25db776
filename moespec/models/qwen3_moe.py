"""Qwen3-MoE (`qwen3_moe`): RMSNorm on each head's q and k; softmax router over all experts,
top-k, renormalised when `norm_topk_prob`; layers listed in `mlp_only_layers` (or off the
`decoder_sparse_step`) are dense."""

from moespec.models.checkpoint import WeightLayout
from moespec.models.config import ModelConfig, common_fields, optional, require

LAYOUT = WeightLayout()


def parse_config(raw: dict) -> ModelConfig:
    fields = common_fields(raw)
    step = int(optional(raw, "decoder_sparse_step", default=1))
    dense = set(optional(raw, "mlp_only_layers", default=[]))
    moe_layers = tuple(
        i not in dense and step > 0 and (i + 1) % step == 0 for i in range(fields["num_layers"])
    )
    return ModelConfig(
        **fields,
        qk_norm="head",
        intermediate_size=int(optional(raw, "intermediate_size", default=0)),
        num_experts=int(require(raw, "num_experts", "num_local_experts")),
        top_k=int(require(raw, "num_experts_per_tok")),
        moe_intermediate_size=int(require(raw, "moe_intermediate_size")),
        norm_topk_prob=bool(optional(raw, "norm_topk_prob", default=False)),
        moe_layers=moe_layers,
    )
