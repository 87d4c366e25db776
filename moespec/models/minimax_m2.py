"""MiniMax-M2 (`minimax_m2`): RMSNorm over the whole q and k projections, rope on the first
`rotary_dim` dims of each head (partial rotary), full attention in every layer; a sigmoid
router whose top k is chosen on the scores plus a per-expert score-correction bias and
weighted by the scores alone, renormalised (GLM-4.5's routing with one group, its bias on
the block rather than the gate); SwiGLU experts named w1 (gate), w3 (up), w2
(down) under `block_sparse_moe`, as transformers' save_pretrained writes them."""

from moespec.models.checkpoint import WeightLayout
from moespec.models.config import GroupRouting, ModelConfig, common_fields, optional, require

LAYOUT = WeightLayout(
    moe_prefix="block_sparse_moe",
    expert_projections=("w1", "w3", "w2"),
    correction_bias="e_score_correction_bias",
)


def parse_config(raw: dict) -> ModelConfig:
    fields = common_fields(raw)
    rotary_dim = optional(raw, "rotary_dim")  # released checkpoints' name for partial rotary
    if rotary_dim is not None:
        fields["rotary_dim"] = int(rotary_dim)
    return ModelConfig(
        **fields,
        qk_norm="projection",
        num_experts=int(require(raw, "num_local_experts", "num_experts")),
        top_k=int(require(raw, "num_experts_per_tok")),
        moe_intermediate_size=int(require(raw, "intermediate_size")),
        norm_topk_prob=True,
        routing=GroupRouting(scoring="sigmoid", correction_bias=True),
    )
