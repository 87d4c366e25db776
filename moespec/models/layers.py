"""Layers shared by every architecture: RMSNorm, rotary embeddings, attention, dense MLP.

Shapes: B = batch, T = tokens of this pass, L = cached + new positions, H = hidden,
N = query heads, K = key/value heads, D = head dim, I = MLP intermediate.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moespec.kernels.invariance import is_batch_invariant
from moespec.kernels.linear import linear, pack
from moespec.kernels.native import attend_one, attention_function
from moespec.models.cache import KVCache
from moespec.models.config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, scaled in the input dtype (as Hugging Face models do).

    weight: [size] over the last dimension, or any shape that broadcasts over it (e.g. [heads,
    D] to norm several heads with their own weights in one call)."""
    dtype = x.dtype
    h = x if dtype == torch.float32 else x.float()
    # HF's h * rsqrt(mean(h^2) + eps), bit for bit, in fewer allocations; no casts in fp32
    h = h * (h * h).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return weight * (h if dtype == torch.float32 else h.to(dtype))


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """theta^(-2i/D) over the rotary dimensions D, with linear, Llama-3 or yarn frequency
    scaling when the config asks for it."""
    dim = config.rotary_dims
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "yarn":
        return yarn_inverse_frequencies(config)
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


def yarn_factor(config: ModelConfig) -> float:
    """Yarn's context extension factor s (given, or the ratio of the contexts)."""
    scaling = config.rope_scaling
    original = float(scaling["original_max_position_embeddings"])
    return float(scaling.get("factor") or config.max_position_embeddings / original)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """0.1 m ln(s) + 1 for s > 1 (Peng et al. 2023, yarn's attention temperature)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """Yarn (Peng et al. 2023, eqs. 17-19): dimensions that turn fewer than beta_slow times
    over the original context are interpolated (divided by s), those that turn more than
    beta_fast times are kept, with a linear ramp between (as transformers computes it)."""
    scaling, dim, base = config.rope_scaling, config.rotary_dims, config.rope_theta
    factor = yarn_factor(config)
    original = float(scaling["original_max_position_embeddings"])
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dimension(rotations: float) -> float:  # the dimension that turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension(fast), dimension(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    positions = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    keep = 1 - ramp  # share of the original (extrapolated) frequency
    return 1.0 / (factor * positions) * (1 - keep) + 1.0 / positions * keep


def rope_attention_factor(config: ModelConfig) -> float:
    """The factor yarn puts on cos and sin (1 for other kinds of rope)."""
    scaling = config.rope_scaling
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = yarn_factor(config)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


class Rotary:
    """cos/sin tables by position, computed in float32, held in the model dtype, grown on
    demand, so that a pass takes its rows as a slice (no per-step tensor creation).

    `sin` carries the sign of rotate_half: x * cos + roll(x, D/2) * sin equals the usual
    x * cos + rotate_half(x) * sin exactly (a sign flip is exact in floating point).
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32):
        self.inv_freq = rope_inverse_frequencies(config)
        self.attention_factor = rope_attention_factor(config)
        self.dtype = dtype
        self.cos = self.sin = torch.empty(0, 1, config.rotary_dims, dtype=dtype)

    def tables(self, start: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, 1, R] of positions start .. start + T - 1 (R rotary dimensions)."""
        needed = start + tokens
        if needed > self.cos.shape[0]:
            size = max(needed, 2 * self.cos.shape[0], 256)
            freqs = torch.arange(size, dtype=torch.float32)[:, None] * self.inv_freq
            half = freqs.shape[1]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
            if self.attention_factor != 1.0:
                cos, sin = cos * self.attention_factor, sin * self.attention_factor
            sin[:, :half] = -sin[:, :half]
            # [P, 1, R]: broadcast over heads without a per-pass unsqueeze
            self.cos, self.sin = cos[:, None].to(self.dtype), sin[:, None].to(self.dtype)
        return self.cos[start:needed], self.sin[start:needed]


def concat(tensors, dim: int = 0) -> torch.Tensor:
    """torch.cat for a loader; on the meta device (a converted model's skeleton,
    moespec.models.converted) the result's shape alone, since the first torch.cat of meta
    tensors imports the compiler stack (1.4 s measured) for a shape."""
    tensors = list(tensors)
    if not tensors[0].is_meta:
        return torch.cat(tensors, dim)
    shape = list(tensors[0].shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    return torch.empty(shape, dtype=tensors[0].dtype, device="meta")


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [..., T, heads, D] with Rotary.tables' signed (cos, sin); with
    R < D rotary dimensions (partial rotary: GLM-4.5, MiniMax-M2, Qwen3.5) the last D - R
    pass unchanged."""
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        return torch.cat((rotate(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)
    return x * cos + x.roll(dim // 2, -1) * sin


@dataclass
class Attention:
    """Grouped-query attention with a KV cache; q, k and v fused into one projection;
    optionally a sink logit per head (gpt-oss) and a sigmoid gate on the output (Qwen3.5)."""

    qkv: torch.Tensor  # [(N + 2K) D, H] (or packed: moespec.kernels.linear)
    o: torch.Tensor  # [H, N D]
    qkv_bias: torch.Tensor | None
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # [D] per head, or [N D] over the projection
    k_norm: torch.Tensor | None
    config: ModelConfig
    sinks: torch.Tensor | None = None  # [N] float32 logits of the attention sinks (gpt-oss)
    output_gate: torch.Tensor | None = None  # [N D, H]: out * sigmoid(gate x) (Qwen3.5)

    def __post_init__(self):
        # Per-head norms of q and k as one weight [N + K, D], so both are normed in one call.
        c = self.config
        self.qk_norm_weight = None
        if c.qk_norm == "head":
            self.qk_norm_weight = concat(
                (
                    self.q_norm.expand(c.num_heads, c.head_dim),
                    self.k_norm.expand(c.num_kv_heads, c.head_dim),
                )
            )

    def __call__(self, x, layer: int, cache: KVCache, cos, sin, mask):
        # x: [B, T, H]; cos, sin: [T, 1, D]; mask: [T, L] boolean or None
        c = self.config
        batch, tokens, _ = x.shape
        heads, kv_heads = c.num_heads, c.num_kv_heads
        qkv = linear(x, self.qkv, self.qkv_bias)
        if c.qk_norm != "projection" and c.clip_qkv is None:
            # q and k side by side: one norm and one rotation for both.
            qkv = qkv.view(batch, tokens, heads + 2 * kv_heads, c.head_dim)
            qk, v = qkv.split((heads + kv_heads, kv_heads), dim=2)
            if self.qk_norm_weight is not None:
                qk = rms_norm(qk, self.qk_norm_weight, c.rms_norm_eps)
            q, k = rotate(qk, cos, sin).split((heads, kv_heads), dim=2)
        else:
            q, k, v = self._project_separately(qkv, cos, sin)
        keys, values = cache.update(layer, k.transpose(1, 2), v.transpose(1, 2))  # [B, K, L, D]
        out = attend(q, keys, values, mask, sinks=self.sinks)  # [B, T, N D]
        if self.output_gate is not None:
            out = out * torch.sigmoid(linear(x, self.output_gate))
        return linear(out, self.o, self.o_bias)

    def new_cache(self, num_layers: int, batch: int, dtype, capacity: int) -> KVCache:
        c = self.config
        return KVCache(num_layers, batch, c.num_kv_heads, c.head_dim, dtype, capacity)

    def tensors(self) -> list:
        """Every weight of the layer's attention (what a pass reads once)."""
        optional = (self.qkv_bias, self.o_bias, self.q_norm, self.k_norm, self.sinks)
        return [*self.products(), *(t for t in optional if t is not None)]

    def products(self) -> list:
        """The weights of its matrix products."""
        return [w for w in (self.qkv, self.o, self.output_gate) if w is not None]

    def pack(self) -> None:
        self.qkv, self.o = pack(self.qkv), pack(self.o)
        if self.output_gate is not None:
            self.output_gate = pack(self.output_gate)

    def _project_separately(self, qkv, cos, sin):
        """q, k, v [B, T, heads, D] for norms over the whole projection (OLMoE) or clipping."""
        c = self.config
        batch, tokens, _ = qkv.shape
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
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
        v = v.view(batch, tokens, c.num_kv_heads, c.head_dim)
        if c.qk_norm == "head":
            q, k = (
                rms_norm(q, self.q_norm, c.rms_norm_eps),
                rms_norm(k, self.k_norm, c.rms_norm_eps),
            )
        return rotate(q, cos, sin), rotate(k, cos, sin), v


def attend(
    q: torch.Tensor, keys, values, mask, scale: float | None = None, sinks=None
) -> torch.Tensor:
    """Scaled dot-product attention of q [B, T, N, D] over the cache's keys [B, K, L, D] and
    values [B, K, L, Dv]; returns [B, T, N Dv]. scale: of the scores (default 1/sqrt(D));
    sinks: [N] logits of attention sinks, or None.

    In reduced precision the library's grouped-query path is slow on CPU (4-6x at T = 1), so
    the G = N / K query heads sharing a key head are laid out as G T query rows of that head
    (same results, bit for bit); in float32 the grouped path is fast and is kept.
    """
    batch, tokens, heads, _ = q.shape
    dim = values.shape[-1]
    if tokens > 1 and is_batch_invariant():
        return _attend_rows(q, keys, values, mask, scale, sinks)
    if tokens == 1 and mask is None and sinks is None and _native_row(q, keys, values):
        return attend_one(q, keys, values, q.shape[-1] ** -0.5 if scale is None else scale)
    if sinks is not None:
        return attend_with_sinks(q, keys, values, mask, sinks, scale)
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    if q.dtype == torch.float32 or group == 1:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=group > 1, scale=scale
        )  # [B, N, T, Dv]
        return out.transpose(1, 2).reshape(batch, tokens, heads * dim)
    if tokens == 1:  # heads n = k G + g are already in row order: views only
        rows = q.reshape(batch, kv_heads, group, q.shape[-1])
        out = F.scaled_dot_product_attention(rows, keys, values, attn_mask=mask, scale=scale)
        return out.reshape(batch, 1, heads * dim)
    rows = q.reshape(batch, tokens, kv_heads, group, q.shape[-1]).permute(0, 2, 1, 3, 4)
    rows = rows.reshape(batch, kv_heads, tokens * group, q.shape[-1])  # row t G + g
    if mask is not None:
        mask = mask.repeat_interleave(group, dim=0)  # [T G, L]
    out = F.scaled_dot_product_attention(rows, keys, values, attn_mask=mask, scale=scale)
    out = out.view(batch, kv_heads, tokens, group, dim).permute(0, 2, 1, 3, 4)
    return out.reshape(batch, tokens, heads * dim)


def _native_row(q, keys, values) -> bool:
    """Whether the native decode attention takes this one-row pass: bf16 on the CPU, batch 1,
    at most 4 query heads per key head, each position's keys and values contiguous, where the
    native loops run. Measured side by side (`benchmarks/attention_row.py`, one thread): at
    16 heads of 128 (OLMoE) the library takes 162-9,963 us over 32-2,048 positions, the native
    path 24-1,223 (6.6-13x); at 4 query heads per key head 1.25-2.0x, at 2 1.3-1.6x. At 8
    (Qwen3-30B-A3B) the library's grouped kernel, which reads each key once for all 8, is as
    fast from 128 positions (the native path, 4 heads a sweep, 0.92-0.98x), so it keeps those."""
    return (
        q.dtype == keys.dtype == values.dtype == torch.bfloat16
        and q.shape[0] == 1
        and q.shape[2] <= 4 * keys.shape[1]
        and q.device.type == "cpu"
        and keys.stride(-1) == 1
        and values.stride(-1) == 1
        and attention_function() is not None
    )


def attend_with_sinks(q, keys, values, mask, sinks, scale=None) -> torch.Tensor:
    """Attention whose softmax over each query's keys also holds its head's sink logit s_n,
    a key of value zero: p_j = exp(z_j) / (exp(s_n) + sum_i exp(z_i)) (gpt-oss; transformers'
    eager_attention_forward). Shapes as in `attend`; head n reads key head n // G."""
    batch, tokens, heads, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    scale = dim**-0.5 if scale is None else scale
    rows = q.view(batch, tokens, kv_heads, group, dim).permute(0, 2, 3, 1, 4)  # [B, K, G, T, D]
    scores = rows @ keys.unsqueeze(2).transpose(-1, -2) * scale  # [B, K, G, T, L]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.view(1, kv_heads, group, 1, 1).expand(batch, -1, -1, tokens, 1)
    logits = torch.cat((scores.float(), sink.float()), dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :-1].to(values.dtype)  # the sink is dropped
    out = probs @ values.unsqueeze(2)  # [B, K, G, T, Dv]
    return out.permute(0, 3, 1, 2, 4).reshape(batch, tokens, heads * values.shape[-1])


def _attend_rows(q, keys, values, mask, scale=None, sinks=None) -> torch.Tensor:
    """Each query row as a one-token pass computes it: over exactly the keys it sees, with
    the mask a one-token pass has (none where it sees them all): batch-invariant attention."""
    tokens = q.shape[1]
    start = keys.shape[2] - tokens
    rows = []
    for i in range(tokens):
        seen = start + i + 1
        row_mask = None if mask is None else mask[i : i + 1, :seen]
        if row_mask is not None and bool(row_mask.all()):
            row_mask = None
        rows.append(
            attend(q[:, i : i + 1], keys[:, :, :seen], values[:, :, :seen], row_mask, scale, sinks)
        )
    return torch.cat(rows, dim=1)


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
        gate, up = linear(x, self.gate_up).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, self.down)

    def tensors(self) -> list:
        return [self.gate_up, self.down]

    products = tensors

    def pack(self) -> None:
        self.gate_up, self.down = pack(self.gate_up), pack(self.down)
