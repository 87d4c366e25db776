"""Models: one file per architecture (named by config.json's `model_type`), shared layers.

model, tokenizer = load_model("path/to/checkpoint", dtype=torch.bfloat16)
"""

import types
from dataclasses import dataclass
from pathlib import Path

import torch

from moespec.models import (
    deepseek_v2,
    glm4_moe,
    gpt_oss,
    llama,
    minimax_m2,
    mixtral,
    olmoe,
    qwen3,
    qwen3_5_moe,
    qwen3_moe,
)
from moespec.models.cache import KVCache
from moespec.models.checkpoint import CheckpointError, TensorReader, expert_weights, read_json
from moespec.models.config import ConfigError, ModelConfig, eos_ids
from moespec.models.context import ContextOverflowError, context_length, fit_context
from moespec.models.layers import Attention, DenseMLP, concat
from moespec.models.memory import loading_heap
from moespec.models.moe import MoEBlock, RoutingSink, route
from moespec.models.tokenizer import StreamingDetokenizer, Tokenizer
from moespec.models.transformer import Layer, Transformer

ARCHITECTURES: dict[str, types.ModuleType] = {
    "qwen3_moe": qwen3_moe,
    "olmoe": olmoe,
    "mixtral": mixtral,
    "qwen3": qwen3,
    "llama": llama,
    "deepseek_v2": deepseek_v2,
    "glm4_moe": glm4_moe,
    "gpt_oss": gpt_oss,
    "minimax_m2": minimax_m2,
    "qwen3_5_moe_text": qwen3_5_moe,
    "qwen3_5_moe": qwen3_5_moe,
}

INT8_FORMATS = ("int8", "int8-experts")  # every large product / the experts alone
DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
}

__all__ = [
    "ARCHITECTURES",
    "CheckpointError",
    "ConfigError",
    "ContextOverflowError",
    "KVCache",
    "ModelConfig",
    "MoEBlock",
    "RoutingSink",
    "StreamingDetokenizer",
    "Tokenizer",
    "Transformer",
    "context_length",
    "fit_context",
    "load_config",
    "check_weights",
    "load_model",
    "parse_dtype",
    "route",
]


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose bf16 or fp32") from None


def check_weights(weights: str | None, dtype: torch.dtype) -> None:
    """A weight format a run of `dtype` can hold: None, an int8 format, or the dtype's name."""
    if weights is None or weights in INT8_FORMATS:
        return
    if weights not in DTYPES:
        raise ValueError(
            f"unknown weight format {weights!r}; choose bf16, fp32, int8 or int8-experts"
        )
    if DTYPES[weights] != dtype:
        raise ValueError(
            f"weights {weights} disagree with the dtype {dtype}: float weights run in the "
            "run's dtype (pass it as the dtype), int8 experts in any"
        )


def load_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint directory (config.json + optional generation_config.json)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint directory")
    raw = read_json(path / "config.json")
    model_type = raw.get("model_type")
    if model_type not in ARCHITECTURES:
        raise CheckpointError(
            f"{path / 'config.json'}: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    try:
        config = ARCHITECTURES[model_type].parse_config(raw)
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{path / 'config.json'}: {error}") from None
    generation = path / "generation_config.json"
    if generation.exists():
        stops = eos_ids(list(config.eos_token_ids), read_json(generation).get("eos_token_id"))
        config = _replace(config, eos_token_ids=stops)
    if not config.name:
        config = _replace(config, name=path.name)
    return config


def _replace(config: ModelConfig, **changes) -> ModelConfig:
    import dataclasses

    return dataclasses.replace(config, **changes)


def load_model(
    path: str | Path,
    dtype: str | torch.dtype | None = None,
    *,
    pack: bool = True,
    pack_experts: bool = True,
    weights: str | None = None,
) -> tuple[Transformer, Tokenizer]:
    """Load a checkpoint directory into a Transformer, with its tokenizer: a Hugging Face
    checkpoint, read one layer at a time into its final layout (`model_parts`), or a
    converted one (moespec.models.converted), whose weights are mapped from its file.
    dtype: the run's (default bf16; a converted model's own).

    Every tensor is checked (present, float, right shape) before the model exists; an error
    names the file and the tensor. pack: re-lay the large weights out for the CPU's fastest
    library path (moespec.kernels.linear); off to compare against the library's default
    path. pack_experts: with `pack`, the experts too (off where the offload engine cannot
    copy the layout they would take: `offload.engine.tiers.keeps_packed_experts`). weights:
    "int8" quantizes the experts, the attention projections, dense MLPs and the head at load
    (one scale per output channel; moespec.kernels.quant), "int8-experts" the experts alone;
    routers, norms and embeddings stay in `dtype`; None or the dtype's own name keeps every
    weight in it.
    """
    path = Path(path)
    from moespec.models import converted

    if converted.is_converted(path):
        return converted.load_converted(
            path, dtype, weights=weights, pack=pack, pack_experts=pack_experts
        )
    config = load_config(path)
    dtype = parse_dtype(dtype or torch.bfloat16)
    check_weights(weights, dtype)
    architecture = ARCHITECTURES[config.model_type]
    tokenizer = Tokenizer(path / "tokenizer.json")
    finish = Finishing(weights if weights in INT8_FORMATS else None, pack, pack_experts)
    model = _build(config, TensorReader(path), architecture, dtype, finish)
    return model, tokenizer


@dataclass(frozen=True)
class Finishing:
    """The final layout of each part, given as soon as the part is read (`model_parts`):
    int8 first (weights "int8": experts, attention, dense MLPs and the head; "int8-experts":
    the experts), then packing (with pack_experts, the experts too)."""

    weights: str | None = None
    pack: bool = True
    pack_experts: bool = True

    def layer(self, layer: Layer) -> None:
        from moespec.models.transformer import pack_layer, quantize_layer

        if self.weights in INT8_FORMATS:
            quantize_layer(layer, dense=self.weights == "int8")
        if self.pack:
            pack_layer(layer, self.pack_experts)

    def head(self, lm_head):
        """The head in its final layout (a head tied to the embeddings becomes a copy only
        where one of them changes it)."""
        from moespec.kernels.linear import dense as dense_weight
        from moespec.kernels.linear import pack as pack_weight
        from moespec.kernels.quant import quantize_int8

        if self.weights == "int8":
            lm_head = quantize_int8(dense_weight(lm_head))
        return pack_weight(lm_head) if self.pack else lm_head


def _build(config: ModelConfig, reader: TensorReader, architecture, dtype, finish=None):
    """The Transformer of `reader`'s tensors, one layer at a time (`model_parts`)."""
    return assemble(config, dict(model_parts(config, reader, architecture, dtype, finish)), dtype)


def assemble(config: ModelConfig, parts: dict, dtype) -> Transformer:
    """The Transformer of `model_parts`' parts."""
    layers = [parts[f"layers.{i}"] for i in range(config.num_layers)]
    return Transformer(config, parts["embed"], layers, parts["norm"], parts["lm_head"], dtype)


def model_parts(config: ModelConfig, reader: TensorReader, architecture, dtype, finish=None):
    """Yield (name, part) in reading order: "embed", "lm_head" (the embeddings themselves
    when tied and unchanged), "layers.0" ... (each a Layer) and "norm", each given its final
    layout by `finish` (a Finishing) as soon as it is read, so loading holds the finished
    parts and one layer's source, never the whole model in `dtype` first; a converter writes
    each part and drops it (moespec.models.converted)."""
    with loading_heap():
        yield from _parts(config, reader, architecture, dtype, finish)


def _parts(config, reader, architecture, dtype, finish):
    c = config
    base = getattr(architecture, "weights_prefix", lambda _: "model")(reader)
    norm = getattr(architecture, "load_norm", _norm)
    embed = reader.get(f"{base}.embed_tokens.weight", (c.vocab_size, c.hidden_size), dtype)
    yield "embed", embed
    if c.tie_word_embeddings or "lm_head.weight" not in reader:
        lm_head = embed
    else:
        lm_head = reader.get("lm_head.weight", (c.vocab_size, c.hidden_size), dtype)
    yield "lm_head", lm_head if finish is None else finish.head(lm_head)
    del lm_head
    for i in range(c.num_layers):
        layer = _build_layer(c, reader, architecture, dtype, f"{base}.layers.{i}", i)
        if finish is not None:
            finish.layer(layer)
        if isinstance(layer.mlp, MoEBlock):  # experts left in the checkpoint are read now
            layer.mlp.experts.materialize()
        yield f"layers.{i}", layer
    yield "norm", norm(reader, f"{base}.norm.weight", c.hidden_size, dtype)


def _build_layer(c: ModelConfig, reader, architecture, dtype, prefix: str, i: int) -> Layer:
    """One decoder layer. Hooks of an architecture module, each optional: `weights_prefix
    (reader)` (where the layers are), `load_norm(reader, name, size, dtype)` (a norm weight
    stored otherwise), `build_attention(config, reader, prefix, dtype)` (attention of its
    own: MLA, gated), `build_linear_attention(...)` (its "linear_attention" layers) and
    `build_moe(config, reader, prefix, layout, dtype)` (experts stored otherwise)."""
    layout = architecture.LAYOUT
    norm = getattr(architecture, "load_norm", _norm)
    h = c.hidden_size
    if c.layer_types and c.layer_types[i] == "linear_attention":
        mixer = architecture.build_linear_attention(c, reader, f"{prefix}.linear_attn", dtype)
    else:
        build_attention = getattr(architecture, "build_attention", _attention)
        mixer = build_attention(c, reader, f"{prefix}.self_attn", dtype)
    if c.moe_layers[i]:
        build_moe = getattr(architecture, "build_moe", _moe_block)
        mlp = build_moe(c, reader, f"{prefix}.{layout.moe_prefix}", layout, dtype)
    else:
        mlp = _dense_mlp(reader, f"{prefix}.mlp", h, c.intermediate_size, dtype)
    return Layer(
        input_norm=norm(reader, f"{prefix}.input_layernorm.weight", h, dtype),
        attention=mixer,
        post_attention_norm=norm(reader, f"{prefix}.post_attention_layernorm.weight", h, dtype),
        mlp=mlp,
    )


def _norm(reader: TensorReader, name: str, size: int, dtype) -> torch.Tensor:
    return reader.get(name, (size,), dtype)


def _attention(c: ModelConfig, reader: TensorReader, attn: str, dtype) -> Attention:
    get = reader.get
    h, d = c.hidden_size, c.head_dim
    q_size, kv_size = c.num_heads * d, c.num_kv_heads * d
    qkv = concat(
        [
            get(f"{attn}.q_proj.weight", (q_size, h), dtype),
            get(f"{attn}.k_proj.weight", (kv_size, h), dtype),
            get(f"{attn}.v_proj.weight", (kv_size, h), dtype),
        ]
    )
    qkv_bias = o_bias = None
    if c.attention_bias:
        qkv_bias = concat(
            [
                get(f"{attn}.q_proj.bias", (q_size,), dtype),
                get(f"{attn}.k_proj.bias", (kv_size,), dtype),
                get(f"{attn}.v_proj.bias", (kv_size,), dtype),
            ]
        )
        if f"{attn}.o_proj.bias" in reader:
            o_bias = get(f"{attn}.o_proj.bias", (h,), dtype)
    q_norm = k_norm = None
    if c.qk_norm == "head":
        q_norm, k_norm = (
            get(f"{attn}.q_norm.weight", (d,), dtype),
            get(f"{attn}.k_norm.weight", (d,), dtype),
        )
    elif c.qk_norm == "projection":
        q_norm = get(f"{attn}.q_norm.weight", (q_size,), dtype)
        k_norm = get(f"{attn}.k_norm.weight", (kv_size,), dtype)
    sinks = get(f"{attn}.sinks", (c.num_heads,), dtype).float() if c.attention_sinks else None
    o = get(f"{attn}.o_proj.weight", (h, q_size), dtype)
    return Attention(qkv, o, qkv_bias, o_bias, q_norm, k_norm, c, sinks)


def _moe_block(c: ModelConfig, reader: TensorReader, moe: str, layout, dtype) -> MoEBlock:
    """Routed experts, their router (float32 for group-limited or sigmoid routing, as
    transformers keeps it, with the correction bias where it has one) and, where the family
    has them, the shared experts (with their gate, Qwen3.5)."""
    h = c.hidden_size
    experts = expert_weights(reader, moe, layout, c.num_experts, h, c.moe_intermediate_size, dtype)
    router_dtype = dtype if c.routing is None else torch.float32
    router = reader.get(f"{moe}.{layout.router}.weight", (c.num_experts, h), router_dtype)
    bias = shared = gate = None
    if c.routing is not None and c.routing.correction_bias:
        bias = reader.get(f"{moe}.{layout.correction_bias}", (c.num_experts,), torch.float32)
    if c.shared_experts:
        inter = c.shared_intermediate_size
        shared = _dense_mlp(reader, f"{moe}.{layout.shared_experts}", h, inter, dtype)
        if layout.shared_gate:
            gate = reader.get(f"{moe}.{layout.shared_gate}.weight", (1, h), dtype)
    return MoEBlock(
        router=router,
        experts=experts,
        top_k=c.top_k,
        renormalize=c.norm_topk_prob,
        routing=c.routing,
        correction_bias=bias,
        shared=shared,
        shared_gate=gate,
    )


def _dense_mlp(reader: TensorReader, prefix: str, hidden: int, inter: int, dtype) -> DenseMLP:
    get = reader.get
    return DenseMLP(
        gate_up=concat(
            [
                get(f"{prefix}.gate_proj.weight", (inter, hidden), dtype),
                get(f"{prefix}.up_proj.weight", (inter, hidden), dtype),
            ]
        ),
        down=get(f"{prefix}.down_proj.weight", (hidden, inter), dtype),
    )
