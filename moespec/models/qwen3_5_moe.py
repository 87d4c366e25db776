"""Qwen3.5-MoE (`qwen3_5_moe_text`, the text model transformers' Qwen3_5MoeForCausalLM
writes): hybrid layers, three Gated DeltaNet linear-attention layers (moespec.models.deltanet)
to one gated full-attention layer as `layer_types` lists them; zero-centred RMSNorm (weight
1 + w) everywhere but inside DeltaNet; attention with per-head q/k norms, rope on the first
quarter of each head, and its output gated by sigmoid(gate x), the gate rows interleaved
per head with the query's in q_proj; a softmax router, top k, renormalised, beside a shared
SwiGLU expert scaled by sigmoid(shared_expert_gate x).

Text positions are the same on the three multimodal rope axes, so the interleaved rope
(`mrope_section`) is the plain one. The KV cache keeps positions for every layer; the
linear layers leave theirs unused.
"""

import torch

from moespec.models.checkpoint import WeightLayout
from moespec.models.config import ModelConfig, common_fields, optional, require
from moespec.models.deltanet import GatedDeltaNet
from moespec.models.layers import Attention, concat

LAYOUT = WeightLayout(shared_experts="shared_expert", shared_gate="shared_expert_gate")
# Keys a multimodal config.json may keep beside its text_config rather than in it.
TOP_LEVEL = ("tie_word_embeddings", "bos_token_id", "eos_token_id", "_name_or_path")


def parse_config(raw: dict) -> ModelConfig:
    if isinstance(raw.get("text_config"), dict):  # the released multimodal checkpoints
        top = {k: raw[k] for k in TOP_LEVEL if k in raw}
        raw = {**top, **raw["text_config"], "model_type": raw["model_type"]}
    fields = common_fields(raw)
    layers = fields["num_layers"]
    interval = int(optional(raw, "full_attention_interval", default=4))
    default_types = [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)
    ]
    return ModelConfig(
        **fields,
        qk_norm="head",
        layer_types=tuple(optional(raw, "layer_types", default=default_types)),
        num_experts=int(require(raw, "num_experts", "num_local_experts")),
        top_k=int(require(raw, "num_experts_per_tok")),
        moe_intermediate_size=int(require(raw, "moe_intermediate_size")),
        norm_topk_prob=True,
        shared_experts=1,
        shared_expert_size=int(require(raw, "shared_expert_intermediate_size")),
        extra={
            "conv_width": int(require(raw, "linear_conv_kernel_dim")),
            "key_heads": int(require(raw, "linear_num_key_heads")),
            "key_dim": int(require(raw, "linear_key_head_dim")),
            "value_heads": int(require(raw, "linear_num_value_heads")),
            "value_dim": int(require(raw, "linear_value_head_dim")),
        },
    )


def weights_prefix(reader) -> str:
    """The text model's: a text checkpoint's (`model.layers...`) or the language model's of
    a multimodal one (`model.language_model.layers...`; its vision tower is not read)."""
    return "model.language_model" if "model.language_model.norm.weight" in reader else "model"


def load_norm(reader, name: str, size: int, dtype) -> torch.Tensor:
    """A zero-centred RMSNorm weight w as the weight 1 + w (in float32, as transformers
    computes it, then in the run's dtype)."""
    return (1.0 + reader.get(name, (size,), torch.float32)).to(dtype)


def build_attention(c: ModelConfig, reader, attn: str, dtype) -> Attention:
    h, d, heads = c.hidden_size, c.head_dim, c.num_heads
    kv_size = c.num_kv_heads * d
    q_and_gate = reader.get(f"{attn}.q_proj.weight", (2 * heads * d, h), dtype)
    per_head = q_and_gate.view(heads, 2 * d, h)  # rows of head n: its query, then its gate
    qkv = concat(
        [
            per_head[:, :d].reshape(heads * d, h),
            reader.get(f"{attn}.k_proj.weight", (kv_size, h), dtype),
            reader.get(f"{attn}.v_proj.weight", (kv_size, h), dtype),
        ]
    )
    return Attention(
        qkv,
        reader.get(f"{attn}.o_proj.weight", (h, heads * d), dtype),
        None,
        None,
        load_norm(reader, f"{attn}.q_norm.weight", d, dtype),
        load_norm(reader, f"{attn}.k_norm.weight", d, dtype),
        c,
        output_gate=per_head[:, d:].reshape(heads * d, h).contiguous(),
    )


def build_linear_attention(c: ModelConfig, reader, name: str, dtype) -> GatedDeltaNet:
    x, h = c.extra, c.hidden_size
    value_size = x["value_heads"] * x["value_dim"]
    channels = 2 * x["key_heads"] * x["key_dim"] + value_size
    heads = x["value_heads"]
    get = reader.get
    return GatedDeltaNet(
        in_qkv=get(f"{name}.in_proj_qkv.weight", (channels, h), dtype),
        in_z=get(f"{name}.in_proj_z.weight", (value_size, h), dtype),
        in_b=get(f"{name}.in_proj_b.weight", (heads, h), dtype),
        in_a=get(f"{name}.in_proj_a.weight", (heads, h), dtype),
        conv=get(f"{name}.conv1d.weight", (channels, 1, x["conv_width"]), dtype)[:, 0],
        dt_bias=get(f"{name}.dt_bias", (heads,), dtype),
        a_log=get(f"{name}.A_log", (heads,), dtype),
        norm=get(f"{name}.norm.weight", (x["value_dim"],), dtype),
        out=get(f"{name}.out_proj.weight", (h, value_size), dtype),
        key_heads=x["key_heads"],
        key_dim=x["key_dim"],
        value_heads=heads,
        value_dim=x["value_dim"],
        eps=c.rms_norm_eps,
    )
