"""Write a checkpoint moespec reads as a GGUF file that llama.cpp runs: the same weights (f32,
bf16, or Q8_0 blocks of 32 weights with one scale), the same hyperparameters and tokenizer.

    summary = export_gguf("checkpoint/", "model.gguf", weight_type="q8_0")

Written with the `gguf` package's GGUFWriter, tensor by tensor: one layer's experts in memory
at a time (read once for its three tensors, dropped after the last), so a full-size export
holds about one layer. Names and metadata keys are llama.cpp's (the `gguf` package's
constants; the per-architecture choices follow llama.cpp's src/models/*.cpp and its
conversion scripts):

- Families: qwen3_moe -> qwen3moe, olmoe -> olmoe, qwen3 -> qwen3, llama -> llama. A setting
  llama.cpp's graph for the family does not implement (dense layers in a qwen3moe, clipped
  q/k/v in olmoe, attention biases, a sliding window) is refused, never written silently.
- Experts stack as [E, I, H] (gate, up) and [E, H, I] (down); routers stay f32, as do norms
  and every 1-D tensor; Q8_0 needs rows of a multiple of 32 and keeps bf16 otherwise.
- llama.cpp's `llama` graph rotates interleaved pairs where Hugging Face rotates halves, so the
  q and k rows of each head are reordered; Llama-3 frequency scaling becomes `rope_freqs`, the
  factors by which moespec's own scaled frequencies divide the plain ones.
"""

import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from moespec.export.vocab import read_vocabulary
from moespec.files import atomic_path, check_writable
from moespec.models import ARCHITECTURES, load_config
from moespec.models.checkpoint import CheckpointError, TensorReader, load_experts, read_json
from moespec.models.config import ModelConfig
from moespec.models.layers import rope_inverse_frequencies

GGUF_ARCHITECTURES = {"qwen3_moe": "qwen3moe", "olmoe": "olmoe", "qwen3": "qwen3", "llama": "llama"}
Q = gguf.GGMLQuantizationType
WEIGHT_TYPES = {"f32": Q.F32, "bf16": Q.BF16, "q8_0": Q.Q8_0}
FILE_TYPES = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "bf16": gguf.LlamaFileType.MOSTLY_BF16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
}
T = gguf.MODEL_TENSOR


@dataclass(frozen=True)
class PlannedTensor:
    name: str  # GGUF name, e.g. blk.0.ffn_gate_exps.weight
    shape: tuple[int, ...]  # numpy order (GGUF stores it reversed)
    qtype: gguf.GGMLQuantizationType
    load: Callable[[], torch.Tensor]  # float32 values

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape) // block * size


def export_gguf(
    model_dir: str | Path, out: str | Path, *, weight_type: str = "bf16", force: bool = False
) -> dict:
    """Write `model_dir` as GGUF to `out` (atomically; an existing file only with force).
    Returns a summary: architecture, weight type, tensors, bytes, tensors kept at bf16."""
    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"unknown weight type {weight_type!r}; choose {', '.join(WEIGHT_TYPES)}")
    model_dir = Path(model_dir)
    check_writable(out, force=force)
    config = load_config(model_dir)
    arch = gguf_architecture(config, model_dir)
    raw = read_json(model_dir / "config.json")
    vocab = read_vocabulary(model_dir / "tokenizer.json", config, raw.get("pad_token_id"))
    reader = TensorReader(model_dir)
    plan = list(tensor_plan(config, reader, WEIGHT_TYPES[weight_type]))
    with atomic_path(out, force=force) as tmp:
        writer = gguf.GGUFWriter(tmp, arch)
        write_hyperparameters(writer, config, arch, weight_type)
        vocab.write(writer)
        for t in plan:
            writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, t.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in plan:
            writer.write_tensor_data(encode(t.load(), t.qtype))
        writer.close()
    return {
        "architecture": arch,
        "weight_type": weight_type,
        "tensors": len(plan),
        "bytes": Path(out).stat().st_size,
        "kept_bf16": [t.name for t in plan if weight_type == "q8_0" and t.qtype == Q.BF16],
        "vocab_size": len(vocab.tokens),
    }


def gguf_architecture(config: ModelConfig, model_dir: Path) -> str:
    """llama.cpp's architecture name for the checkpoint, or an error naming what it lacks."""
    where = model_dir / "config.json"
    arch = GGUF_ARCHITECTURES.get(config.model_type)
    if arch is None:
        raise CheckpointError(
            f"{where}: model_type {config.model_type!r} cannot be exported to GGUF "
            f"(supported: {', '.join(GGUF_ARCHITECTURES)})"
        )
    problems = []
    if config.attention_bias:
        problems.append("attention biases")
    if config.sliding_window:
        problems.append("a sliding window")
    if arch == "qwen3moe" and not all(config.moe_layers):
        problems.append("dense layers (llama.cpp's qwen3moe has experts in every layer)")
    if arch == "qwen3moe" and not config.norm_topk_prob:
        problems.append("norm_topk_prob = false (llama.cpp's qwen3moe renormalises)")
    if arch == "olmoe":
        if config.clip_qkv is not None:
            problems.append("clip_qkv (llama.cpp's olmoe does not clip)")
        if config.norm_topk_prob:
            problems.append("norm_topk_prob = true (llama.cpp's olmoe does not renormalise)")
        if config.num_kv_heads != config.num_heads:
            problems.append("grouped keys and values (llama.cpp's olmoe needs kv heads = heads)")
        if config.num_heads * config.head_dim != config.hidden_size:
            problems.append("heads x head_dim != hidden_size")
    if config.rope_scaling and arch != "llama":
        problems.append("rope scaling")
    if problems:
        raise CheckpointError(
            f"{where}: {arch} in llama.cpp does not support {', '.join(problems)}"
        )
    return arch


def write_hyperparameters(writer, c: ModelConfig, arch: str, weight_type: str) -> None:
    writer.add_name(c.name or arch)
    writer.add_file_type(FILE_TYPES[weight_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_layers)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    if c.is_moe:
        writer.add_expert_count(c.num_experts)
        writer.add_expert_used_count(c.top_k)
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
        writer.add_feed_forward_length(c.intermediate_size or c.moe_intermediate_size)
    elif arch == "olmoe":  # its experts' size is the feed-forward length
        writer.add_feed_forward_length(c.moe_intermediate_size)
    else:
        writer.add_feed_forward_length(c.intermediate_size)
    if arch == "llama":
        writer.add_vocab_size(c.vocab_size)
        writer.add_rope_dimension_count(c.head_dim)
        if rope_kind(c) == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(c.rope_scaling["factor"]))


def tensor_plan(c: ModelConfig, reader: TensorReader, weight: gguf.GGMLQuantizationType):
    """Every tensor of the GGUF file, in file order, each loaded only when written."""
    layout = ARCHITECTURES[c.model_type].LAYOUT

    def matrix(gguf_name: str, hf_name: str, shape, transform=None):
        def load():
            value = reader.get(hf_name, shape, torch.float32)
            return transform(value) if transform else value

        return PlannedTensor(gguf_name, tuple(shape), matrix_type(weight, shape), load)

    def vector(gguf_name: str, hf_name: str, shape):
        return PlannedTensor(
            gguf_name, tuple(shape), Q.F32, lambda: reader.get(hf_name, shape, torch.float32)
        )

    v, h = c.vocab_size, c.hidden_size
    yield matrix(name(T.TOKEN_EMBD), "model.embed_tokens.weight", (v, h))
    yield vector(name(T.OUTPUT_NORM), "model.norm.weight", (h,))
    tied = c.tie_word_embeddings or "lm_head.weight" not in reader
    if not tied:
        yield matrix(name(T.OUTPUT), "lm_head.weight", (v, h))
    elif c.model_type == "olmoe":  # llama.cpp's olmoe requires an output matrix
        yield matrix(name(T.OUTPUT), "model.embed_tokens.weight", (v, h))
    if c.model_type == "llama" and rope_kind(c) == "llama3":
        factors = rope_factors(c)
        yield PlannedTensor(name(T.ROPE_FREQS), tuple(factors.shape), Q.F32, lambda: factors)
    for i in range(c.num_layers):
        yield from layer_plan(c, reader, layout, weight, i, matrix, vector)


def layer_plan(c, reader, layout, weight, i, matrix, vector) -> Iterator[PlannedTensor]:
    p, h, d = f"model.layers.{i}", c.hidden_size, c.head_dim
    q_size, kv_size = c.num_heads * d, c.num_kv_heads * d
    q_order = k_order = None
    if c.model_type == "llama":
        q_order = functools.partial(interleave_rotary_rows, heads=c.num_heads)
        k_order = functools.partial(interleave_rotary_rows, heads=c.num_kv_heads)
    yield vector(name(T.ATTN_NORM, i), f"{p}.input_layernorm.weight", (h,))
    yield matrix(name(T.ATTN_Q, i), f"{p}.self_attn.q_proj.weight", (q_size, h), q_order)
    yield matrix(name(T.ATTN_K, i), f"{p}.self_attn.k_proj.weight", (kv_size, h), k_order)
    yield matrix(name(T.ATTN_V, i), f"{p}.self_attn.v_proj.weight", (kv_size, h))
    yield matrix(name(T.ATTN_OUT, i), f"{p}.self_attn.o_proj.weight", (h, q_size))
    if c.qk_norm != "none":
        q_norm, k_norm = ((d,), (d,)) if c.qk_norm == "head" else ((q_size,), (kv_size,))
        yield vector(name(T.ATTN_Q_NORM, i), f"{p}.self_attn.q_norm.weight", q_norm)
        yield vector(name(T.ATTN_K_NORM, i), f"{p}.self_attn.k_norm.weight", k_norm)
    yield vector(name(T.FFN_NORM, i), f"{p}.post_attention_layernorm.weight", (h,))
    if not c.moe_layers[i]:
        inter = c.intermediate_size
        yield matrix(name(T.FFN_GATE, i), f"{p}.mlp.gate_proj.weight", (inter, h))
        yield matrix(name(T.FFN_UP, i), f"{p}.mlp.up_proj.weight", (inter, h))
        yield matrix(name(T.FFN_DOWN, i), f"{p}.mlp.down_proj.weight", (h, inter))
        return
    moe, e, inter = f"{p}.{layout.moe_prefix}", c.num_experts, c.moe_intermediate_size
    router = PlannedTensor(
        name(T.FFN_GATE_INP, i),
        (e, h),
        Q.F32,
        lambda: reader.get(f"{moe}.{layout.router}.weight", (e, h), torch.float32),
    )
    yield router

    held = {}  # the three expert tensors of the layer come from one read, held until the last

    def experts(last: bool = False):
        if "experts" not in held:
            held["experts"] = load_experts(reader, moe, layout, e, h, inter, torch.float32)
        return held.pop("experts") if last else held["experts"]

    yield PlannedTensor(
        name(T.FFN_GATE_EXP, i),
        (e, inter, h),
        matrix_type(weight, (h,)),
        lambda: experts()[0][:, :inter],
    )
    yield PlannedTensor(
        name(T.FFN_UP_EXP, i),
        (e, inter, h),
        matrix_type(weight, (h,)),
        lambda: experts()[0][:, inter:],
    )
    yield PlannedTensor(
        name(T.FFN_DOWN_EXP, i),
        (e, h, inter),
        matrix_type(weight, (inter,)),
        lambda: experts(last=True)[1],
    )


def name(tensor: gguf.MODEL_TENSOR, layer: int | None = None) -> str:
    base = gguf.TENSOR_NAMES[tensor]
    return (base.format(bid=layer) if layer is not None else base) + ".weight"


def matrix_type(weight: gguf.GGMLQuantizationType, shape) -> gguf.GGMLQuantizationType:
    """The weight type of a matrix; Q8_0 blocks run along rows of a multiple of 32 only."""
    block = gguf.GGML_QUANT_SIZES[weight][0]
    return weight if shape[-1] % block == 0 else Q.BF16


def encode(values: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """The bytes of a float32 tensor in the GGUF type (bf16 by rounding to nearest even)."""
    values = values.contiguous()
    if qtype == Q.F32:
        return values.numpy()
    if qtype == Q.BF16:
        return values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return gguf.quants.quantize(values.numpy(), qtype)


def interleave_rotary_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Reorder each head's rows from halves (x_0..x_{D/2-1} | x_{D/2}..) to interleaved
    pairs (x_0, x_{D/2}, x_1, ...), the pairs llama.cpp's `llama` rotary embedding rotates."""
    rows, cols = weight.shape
    d = rows // heads
    # [heads, 2, D/2, cols] -> [heads, D/2, 2, cols]
    return weight.reshape(heads, 2, d // 2, cols).transpose(1, 2).reshape(rows, cols)


def rope_kind(c: ModelConfig) -> str | None:
    scaling = c.rope_scaling or {}
    return scaling.get("rope_type", scaling.get("type"))


def rope_factors(c: ModelConfig) -> torch.Tensor:
    """Per frequency, plain theta^(-2i/D) over the scaled one: llama.cpp's `rope_freqs`."""
    dim = c.head_dim
    plain = 1.0 / (c.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return (plain / rope_inverse_frequencies(c)).float()
