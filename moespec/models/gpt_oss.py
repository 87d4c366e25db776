"""gpt-oss (`gpt_oss`): attention with biases and a learned sink per head, sliding-window and
full attention layers alternating (`layer_types`), YaRN rope; a router with a bias whose
top k logits are softmaxed; experts with biases and a clamped SwiGLU (`ClampedSwiGLU`).

Checkpoints hold each layer's experts fused and transposed, gate and up interleaved by
column: gate_up_proj [E, H, 2I] with gate = [..., 0::2], up = [..., 1::2], down_proj
[E, I, H]; or, as released, in MXFP4 (`*_blocks`, `*_scales`; moespec.models.mxfp4),
dequantised here at load to the run's dtype (the experts are not kept 4-bit in memory).
"""

import torch

from moespec.kernels import ExpertWeights
from moespec.kernels.experts import ClampedSwiGLU
from moespec.models import mxfp4
from moespec.models.checkpoint import CheckpointError, WeightLayout
from moespec.models.config import (
    ConfigError,
    GroupRouting,
    ModelConfig,
    common_fields,
    optional,
    require,
)
from moespec.models.layers import concat
from moespec.models.moe import MoEBlock

LAYOUT = WeightLayout(router="router")
QUANTIZATION_METHODS = ("mxfp4",)


def parse_config(raw: dict) -> ModelConfig:
    quantization = raw.get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        if method not in QUANTIZATION_METHODS:
            raise ConfigError(
                f"quantization_config.quant_method {method!r} is not supported (mxfp4)"
            )
    fields = common_fields(raw)
    layers = fields["num_layers"]
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    window = optional(raw, "sliding_window")
    return ModelConfig(
        **{**fields, "attention_bias": bool(optional(raw, "attention_bias", default=True))},
        sliding_window=int(window) if window is not None else None,
        layer_types=tuple(optional(raw, "layer_types", default=alternating)),
        attention_sinks=True,
        num_experts=int(require(raw, "num_local_experts", "num_experts")),
        top_k=int(require(raw, "num_experts_per_tok")),
        moe_intermediate_size=int(require(raw, "intermediate_size")),
        routing=GroupRouting(scoring="softmax_topk"),
        extra={
            "activation": ClampedSwiGLU(
                alpha=float(optional(raw, "swiglu_alpha", default=1.702)),
                limit=float(optional(raw, "swiglu_limit", default=7.0)),
            )
        },
    )


def build_moe(c: ModelConfig, reader, moe: str, layout: WeightLayout, dtype) -> MoEBlock:
    """The router (weight and bias) and the experts of the MoE block under `moe`."""
    e, h, inter = c.num_experts, c.hidden_size, c.moe_intermediate_size
    experts = f"{moe}.experts"
    gate_up, down = _expert_matrices(reader, experts, e, h, inter, dtype)
    gate_up_bias = reader.get(f"{experts}.gate_up_proj_bias", (e, 2 * inter), dtype)
    return MoEBlock(
        router=reader.get(f"{moe}.{layout.router}.weight", (e, h), dtype),
        router_bias=reader.get(f"{moe}.{layout.router}.bias", (e,), dtype),
        experts=ExpertWeights(
            _gate_then_up(gate_up),
            down,
            gate_up_bias=_gate_then_up(gate_up_bias),
            down_bias=reader.get(f"{experts}.down_proj_bias", (e, h), dtype),
            activation=c.extra["activation"],
        ),
        top_k=c.top_k,
        renormalize=False,
        routing=c.routing,
    )


def _expert_matrices(reader, experts: str, e: int, h: int, inter: int, dtype):
    """(gate_up [E, 2I, H] interleaved, down [E, H, I]) from bf16/fp32 or MXFP4 tensors."""
    if f"{experts}.gate_up_proj_blocks" in reader or f"{experts}.down_proj_blocks" in reader:
        gate_up = _dequantized(reader, f"{experts}.gate_up_proj", (e, 2 * inter, h), dtype)
        return gate_up, _dequantized(reader, f"{experts}.down_proj", (e, h, inter), dtype)
    gate_up = reader.get(f"{experts}.gate_up_proj", (e, h, 2 * inter), dtype)
    down = reader.get(f"{experts}.down_proj", (e, inter, h), dtype)
    return gate_up.transpose(1, 2), down.transpose(1, 2).contiguous()


def _dequantized(reader, name: str, shape: tuple[int, int, int], dtype) -> torch.Tensor:
    """The MXFP4 tensor `name` [E, out, in], from `name`_blocks and `name`_scales."""
    e, rows, columns = shape
    if columns % mxfp4.BLOCK:
        raise CheckpointError(
            f"{name}_blocks: {columns} inputs are not a whole number of MXFP4 blocks of "
            f"{mxfp4.BLOCK}"
        )
    groups = columns // mxfp4.BLOCK
    blocks = reader.get_bytes(f"{name}_blocks", (e, rows, groups, mxfp4.BLOCK // 2))
    scales = reader.get_bytes(f"{name}_scales", (e, rows, groups))
    out = torch.empty(shape, dtype=dtype, device=reader.device)
    if out.is_meta:  # a converted model's skeleton (moespec.models.converted): shapes only
        return out
    for expert in range(e):  # one expert at a time: the float32 codes stay small
        out[expert] = mxfp4.dequantize(blocks[expert], scales[expert], dtype)
    return out


def _gate_then_up(interleaved: torch.Tensor) -> torch.Tensor:
    """[E, 2I, ...] with gate and up rows interleaved -> gate rows, then up rows (a
    permutation: the kernels' fused layout, with the same values)."""
    return concat((interleaved[:, 0::2], interleaved[:, 1::2]), dim=1).contiguous()
