"""Layers shared by every architecture: RMSNorm, rotary embeddings, attention, dense MLP.

Shapes: B = batch, T = tokens of this pass, L = cached + new positions, H = hidden,
N = query heads, K = key/value heads, D = head dim, I = MLP intermediate.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moespec.kernels.linear import linear
from moespec.models.cache import KVCache
from moespec.models.config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, scaled in the input dtype (as Hugging Face models do)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """theta^(-2i/D), with linear or Llama-3 frequency scaling when the config asks for it."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    # llama3: keep high frequencies, divide low ones by factor, interpolate between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_context / high) & ~(wavelen > old_context / low)
    return torch.where(medium, smoothed, scaled)


class Rotary:
    """cos/sin tables by position, computed in float32 and grown on demand."""

    def __init__(self, config: ModelConfig):
        self.inv_freq = rope_inverse_frequencies(config)
        self.cos = self.sin = torch.empty(0, config.head_dim)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype):
        needed = int(positions.max()) + 1
        if needed > self.cos.shape[0]:
            size = max(needed, 2 * self.cos.shape[0], 256)
            freqs = torch.arange(size, dtype=torch.float32)[:, None] * self.inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            self.cos, self.sin = emb.cos(), emb.sin()
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass
class Attention:
    """Grouped-query attention with a KV cache; q, k and v fused into one projection."""

    qkv: torch.Tensor  # [(N + 2K) D, H] (or packed: moespec.kernels.linear)
    o: torch.Tensor  # [H, N D]
    qkv_bias: torch.Tensor | None
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # [D] per head, or [N D] over the projection
    k_norm: torch.Tensor | None
    config: ModelConfig

    def __call__(self, x, layer: int, cache: KVCache, cos, sin, mask):
        # x: [B, T, H]; cos, sin: [T, D]; mask: [T, L] boolean or None
        c = self.config
        batch, tokens, _ = x.shape
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        qkv = linear(x, self.qkv, self.qkv_bias)
        q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
        if c.qk_norm == "projection":
            q, k = (
                rms_norm(q, self.q_norm, c.rms_norm_eps),
                rms_norm(k, self.k_norm, c.rms_norm_eps),
            )
        if c.clip_qkv is not None:
            q, k, v = (t.clamp(-c.clip_qkv, c.clip_qkv) for t in (q, k, v))
        q = q.view(batch, tokens, c.num_heads, c.head_dim)
        k = k.view(batch, tokens, c.num_kv_heads, c.head_dim)
        v = v.view(batch, tokens, c.num_kv_heads, c.head_dim).transpose(1, 2)
        if c.qk_norm == "head":
            q, k = (
                rms_norm(q, self.q_norm, c.rms_norm_eps),
                rms_norm(k, self.k_norm, c.rms_norm_eps),
            )
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, N or K, T, D]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        keys, values = cache.update(layer, k, v)  # [B, K, L, D]
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, enable_gqa=c.num_heads != c.num_kv_heads
        )
        out = out.transpose(1, 2).reshape(batch, tokens, q_size)
        return linear(out, self.o, self.o_bias)


def attention_mask(start: int, tokens: int, window: int | None) -> torch.Tensor | None:
    """[T, start + T]: query i (at position start + i) sees keys at positions <= its own."""
    if tokens == 1 and (window is None or start < window):
        return None
    query = torch.arange(start, start + tokens)[:, None]
    key = torch.arange(start + tokens)[None, :]
    mask = key <= query
    if window is not None:
        mask &= key > query - window
    return mask


@dataclass
class DenseMLP:
    """SwiGLU MLP with gate and up fused: down(silu(gate x) * up x)."""

    gate_up: torch.Tensor  # [2I, H]
    down: torch.Tensor  # [H, I]

    def __call__(self, x: torch.Tensor, **_) -> torch.Tensor:
        hidden = linear(x, self.gate_up)
        inter = self.down.shape[1]
        return linear(F.silu(hidden[..., :inter]) * hidden[..., inter:], self.down)
