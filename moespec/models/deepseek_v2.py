"""DeepSeek-V2 (`deepseek_v2`, V2 and V2-Lite): multi-head latent attention with a compressed
cache; routed experts (softmax router, greedy or group-limited top-k, times the routed scaling
factor) beside shared experts; the first `first_k_dense_replace` layers dense.

As transformers' DeepseekV2 (the oracle) does: `norm_topk_prob` is not read, the latent
norms use eps 1e-6, rope pairs are interleaved (permuted here at load into the halves our
Rotary turns), and yarn scales the softmax by mscale(s, mscale_all_dim)^2.

Shapes: B = batch, T = tokens, L = cached + new positions, H = hidden, N = heads,
C = kv_lora_rank (d_c), R = qk_rope_head_dim (d_h^R), P = qk_nope_head_dim, V = v_head_dim.
"""

from dataclasses import dataclass

import torch

from moespec.kernels.invariance import is_batch_invariant
from moespec.kernels.linear import linear, pack
from moespec.models.cache import LatentCache
from moespec.models.checkpoint import TensorReader, WeightLayout
from moespec.models.config import (
    ConfigError,
    GroupRouting,
    LatentAttentionConfig,
    ModelConfig,
    common_fields,
    optional,
    require,
)
from moespec.models.layers import attend, concat, rms_norm, rotate, yarn_mscale

LAYOUT = WeightLayout()
LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV2RMSNorm default, for q_a and kv_a norms


def parse_config(raw: dict) -> ModelConfig:
    if raw.get("mlp_bias"):
        raise ConfigError("mlp_bias = true is not supported")
    fields = common_fields(raw)
    # head_dim is the rotary part, as in transformers: what Rotary and the rope scaling see.
    fields["head_dim"] = int(require(raw, "qk_rope_head_dim"))
    fields["rotary_dim"] = 0  # all of it
    dense = int(optional(raw, "first_k_dense_replace", default=0))
    return ModelConfig(
        **fields,
        intermediate_size=int(optional(raw, "intermediate_size", default=0)),
        num_experts=int(require(raw, "n_routed_experts", "num_experts")),
        top_k=int(require(raw, "num_experts_per_tok")),
        moe_intermediate_size=int(require(raw, "moe_intermediate_size")),
        moe_layers=tuple(i >= dense for i in range(fields["num_layers"])),
        routing=_routing(raw),
        shared_experts=int(optional(raw, "n_shared_experts", default=0)),
        latent_attention=_latent_attention(raw, fields["rope_scaling"]),
    )


def _routing(raw: dict) -> GroupRouting:
    method = optional(raw, "topk_method", default="greedy")
    scale = float(optional(raw, "routed_scaling_factor", default=1.0))
    if method == "greedy":
        return GroupRouting(scoring="softmax", scale=scale)
    if method == "group_limited_greedy":
        return GroupRouting(
            scoring="softmax",
            groups=int(require(raw, "n_group")),
            top_groups=int(require(raw, "topk_group")),
            group_score="max",
            scale=scale,
        )
    raise ConfigError(f"topk_method {method!r} is not supported (greedy, group_limited_greedy)")


def _latent_attention(raw: dict, scaling: dict | None) -> LatentAttentionConfig:
    nope, rope = int(require(raw, "qk_nope_head_dim")), int(require(raw, "qk_rope_head_dim"))
    if rope % 2:
        raise ConfigError(f"qk_rope_head_dim must be even, got {rope}")
    scale = (nope + rope) ** -0.5
    if scaling and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
    q_rank = optional(raw, "q_lora_rank")
    return LatentAttentionConfig(
        kv_lora_rank=int(require(raw, "kv_lora_rank")),
        q_lora_rank=int(q_rank) if q_rank is not None else None,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=int(require(raw, "v_head_dim")),
        softmax_scale=scale,
    )


def head_products(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [B, T, N, a] times each head's own weight [N, a, b] -> [B, T, N, b]. Under batch
    invariance, one token at a time: the product a one-token pass runs."""
    if x.shape[1] > 1 and is_batch_invariant():
        return torch.cat([head_products(x[:, t : t + 1], weight) for t in range(x.shape[1])], 1)
    return torch.matmul(x.transpose(1, 2), weight).transpose(1, 2)


@dataclass
class LatentAttention:
    """Multi-head latent attention (DeepSeek-V2 §2.1, eqs. 9-19) in its absorbed form: the
    cache holds per position only c_KV (C) and the shared rotary key k_R (R); each head's
    key up-projection W_UK is applied to its query, and its value up-projection W_UV to its
    attention output, so no per-head key or value is ever made (same scores and outputs as
    transformers' expanded form, reassociated)."""

    q_a: torch.Tensor | None  # [q_lora_rank, H], or None: q from h directly
    q_a_bias: torch.Tensor | None
    q_a_norm: torch.Tensor | None  # [q_lora_rank]
    q: torch.Tensor  # [N (P + R), q_lora_rank or H]; rotary rows in halves order
    kv_a: torch.Tensor  # [C + R, H]; rotary rows in halves order
    kv_a_bias: torch.Tensor | None
    kv_a_norm: torch.Tensor  # [C]
    absorb_key: torch.Tensor  # [N, P, C]: W_UK of each head
    absorb_value: torch.Tensor  # [N, C, V]: W_UV of each head, transposed
    o: torch.Tensor  # [H, N V]
    o_bias: torch.Tensor | None
    config: ModelConfig

    def __call__(self, x, layer: int, cache: LatentCache, cos, sin, mask):
        # x: [B, T, H]; cos, sin: [T, 1, R]; mask: [T, L] boolean or None
        a = self.config.latent_attention
        batch, tokens, _ = x.shape
        heads, latent = self.config.num_heads, a.kv_lora_rank
        q_in = x
        if self.q_a is not None:
            q_in = rms_norm(linear(x, self.q_a, self.q_a_bias), self.q_a_norm, LATENT_NORM_EPS)
        q = linear(q_in, self.q).view(batch, tokens, heads, -1)
        q_nope, q_rope = q.split((a.qk_nope_head_dim, a.qk_rope_head_dim), dim=-1)
        compressed = linear(x, self.kv_a, self.kv_a_bias)  # [B, T, C + R]
        c_kv, k_rope = compressed.split((latent, a.qk_rope_head_dim), dim=-1)
        c_kv = rms_norm(c_kv, self.kv_a_norm, LATENT_NORM_EPS)
        k_rope = rotate(k_rope[:, :, None], cos, sin)  # [B, T, 1, R]
        rows = torch.cat((c_kv[:, :, None], k_rope), dim=-1).transpose(1, 2)  # [B, 1, T, C + R]
        rows = cache.update_rows(layer, rows)  # [B, 1, L, C + R]
        query = torch.cat(
            (head_products(q_nope, self.absorb_key), rotate(q_rope, cos, sin)), dim=-1
        )  # [B, T, N, C + R]
        out = attend(query, rows, rows[..., :latent], mask, a.softmax_scale)  # [B, T, N C]
        out = head_products(out.view(batch, tokens, heads, latent), self.absorb_value)
        return linear(out.reshape(batch, tokens, -1), self.o, self.o_bias)

    def new_cache(self, num_layers: int, batch: int, dtype, capacity: int) -> LatentCache:
        a = self.config.latent_attention
        return LatentCache(num_layers, batch, a.kv_lora_rank + a.qk_rope_head_dim, dtype, capacity)

    def tensors(self) -> list:
        """Every weight of the layer's attention (what a pass reads once)."""
        weights = [self.q_a, self.q_a_bias, self.q_a_norm, self.q, self.kv_a, self.kv_a_bias]
        weights += [self.kv_a_norm, self.absorb_key, self.absorb_value, self.o, self.o_bias]
        return [w for w in weights if w is not None]

    def products(self) -> list:
        """The weights of its matrix products through `linear`."""
        return [w for w in (self.q_a, self.q, self.kv_a, self.o) if w is not None]

    def pack(self) -> None:
        if self.q_a is not None:
            self.q_a = pack(self.q_a)
        self.q, self.kv_a, self.o = pack(self.q), pack(self.kv_a), pack(self.o)


def halves_order(dim: int) -> torch.Tensor:
    """The permutation taking interleaved rotary pairs (2i, 2i + 1), as DeepSeek's complex
    rope turns them, to the pairs (i, i + dim/2) that rotate_half turns."""
    return torch.cat((torch.arange(0, dim, 2), torch.arange(1, dim, 2)))


def build_attention(c: ModelConfig, reader: TensorReader, attn: str, dtype) -> LatentAttention:
    """The layer's latent attention from its checkpoint tensors (each checked by name and
    shape); the rotary rows are permuted and kv_b_proj split into W_UK and W_UV per head."""
    a, get = c.latent_attention, reader.get
    h, heads, latent = c.hidden_size, c.num_heads, a.kv_lora_rank
    nope, rope, value = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
    order = halves_order(rope)
    q_a = q_a_bias = q_a_norm = None
    q_in = h
    if a.q_lora_rank is not None:
        q_in = a.q_lora_rank
        q_a = get(f"{attn}.q_a_proj.weight", (q_in, h), dtype)
        q_a_norm = get(f"{attn}.q_a_layernorm.weight", (q_in,), dtype)
        if c.attention_bias:
            q_a_bias = get(f"{attn}.q_a_proj.bias", (q_in,), dtype)
        q = get(f"{attn}.q_b_proj.weight", (heads * (nope + rope), q_in), dtype)
    else:
        q = get(f"{attn}.q_proj.weight", (heads * (nope + rope), h), dtype)
    q = q.view(heads, nope + rope, q_in)
    q = concat((q[:, :nope], q[:, nope:][:, order]), dim=1).reshape(-1, q_in)
    kv_a = get(f"{attn}.kv_a_proj_with_mqa.weight", (latent + rope, h), dtype)
    kv_a = concat((kv_a[:latent], kv_a[latent:][order]))
    kv_a_bias = None
    if c.attention_bias:
        kv_a_bias = get(f"{attn}.kv_a_proj_with_mqa.bias", (latent + rope,), dtype)
        kv_a_bias = concat((kv_a_bias[:latent], kv_a_bias[latent:][order]))
    kv_b = get(f"{attn}.kv_b_proj.weight", (heads * (nope + value), latent), dtype)
    kv_b = kv_b.view(heads, nope + value, latent)
    o_bias = get(f"{attn}.o_proj.bias", (h,), dtype) if c.attention_bias else None
    return LatentAttention(
        q_a=q_a,
        q_a_bias=q_a_bias,
        q_a_norm=q_a_norm,
        q=q,
        kv_a=kv_a,
        kv_a_bias=kv_a_bias,
        kv_a_norm=get(f"{attn}.kv_a_layernorm.weight", (latent,), dtype),
        absorb_key=kv_b[:, :nope].contiguous(),
        absorb_value=kv_b[:, nope:].transpose(1, 2).contiguous(),
        o=get(f"{attn}.o_proj.weight", (h, heads * value), dtype),
        o_bias=o_bias,
        config=c,
    )
