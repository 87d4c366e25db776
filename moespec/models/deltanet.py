"""Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks"), the linear
attention of Qwen3.5's hybrid layers, as transformers computes it (`Qwen3_5MoeGatedDeltaNet`).

Per token t and value head h, with q, k L2-normalised (q also scaled by 1/sqrt(d_k)):
    S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T,    o_t = S_t^T q_t
with decay a_t = exp(-exp(A_log) softplus(alpha_t + dt_bias)) and beta_t = sigmoid(b_t); q, k, v
come from a causal depthwise convolution (width k_conv) of one projection, then SiLU; the output
is RMSNorm(o) * silu(z), projected back. Shapes: B, T, H as in layers.py; C = conv channels
(2 K d_k + V d_v), K = key heads, V = value heads.

The state lives beside the cache (one per cache object): the convolution's last k_conv - 1
inputs and S, snapshot after every token of a verification pass (up to MAX_PASS tokens) and
at the ends of longer passes, so a rollback to any position of the last pass restores it.
"""

import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from moespec.kernels.invariance import MAX_PASS
from moespec.kernels.linear import linear, pack

L2_EPS = 1e-6


@dataclass
class LinearState:
    conv: torch.Tensor  # [B, C, k_conv - 1] the last inputs of the convolution
    recurrent: torch.Tensor  # [B, V, d_k, d_v] float32


@dataclass
class GatedDeltaNet:
    in_qkv: torch.Tensor  # [C, H]
    in_z: torch.Tensor  # [V d_v, H]
    in_b: torch.Tensor  # [V, H]
    in_a: torch.Tensor  # [V, H]
    conv: torch.Tensor  # [C, k_conv]
    dt_bias: torch.Tensor  # [V]
    a_log: torch.Tensor  # [V]
    norm: torch.Tensor  # [d_v]
    out: torch.Tensor  # [H, V d_v]
    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int
    eps: float
    # {cache: {position: LinearState}}: the states a rollback can return to
    _states: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)

    def products(self) -> list:
        return [self.in_qkv, self.in_z, self.in_b, self.in_a, self.out]

    def tensors(self) -> list[torch.Tensor]:
        return self.products() + [self.conv, self.dt_bias, self.a_log, self.norm]

    def pack(self) -> None:
        self.in_qkv, self.in_z, self.out = pack(self.in_qkv), pack(self.in_z), pack(self.out)

    def __call__(self, x, layer: int, cache, cos, sin, mask):
        # x: [B, T, H]; rope and mask are for attention layers: a recurrence needs neither
        batch, tokens, _ = x.shape
        start = cache.length
        state = self._state(cache, start, batch, x.dtype)
        mixed, convs = self._convolve(linear(x, self.in_qkv), state.conv)  # [B, T, C]
        q, k, v = mixed.split(
            (self.key_heads * self.key_dim,) * 2 + (self.value_heads * self.value_dim,), -1
        )
        beta = torch.sigmoid(linear(x, self.in_b)).float()  # [B, T, V]
        decay = -self.a_log.float().exp() * F.softplus(linear(x, self.in_a).float() + self.dt_bias)
        keep = set(range(tokens + 1)) if tokens <= MAX_PASS else {0, tokens}
        outputs, states = self._recur(q, k, v, beta, decay, state.recurrent, keep)
        self._states[cache] = {start + t: LinearState(convs[t], states[t]) for t in keep}
        z = linear(x, self.in_z).view(batch, tokens, self.value_heads, self.value_dim)
        h = outputs.to(x.dtype).float()  # [B, T, V, d_v]
        h = h * (h * h).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        h = (self.norm * h.to(x.dtype)) * F.silu(z.float())
        return linear(h.to(x.dtype).reshape(batch, tokens, -1), self.out)

    def _state(self, cache, start: int, batch: int, dtype) -> LinearState:
        """The state after `start` positions of this cache (fresh at 0)."""
        if start == 0:
            channels, width = self.conv.shape
            return LinearState(
                torch.zeros(batch, channels, width - 1, dtype=dtype),
                torch.zeros(batch, self.value_heads, self.key_dim, self.value_dim),
            )
        saved = self._states.get(cache, {})
        if start not in saved:
            raise ValueError(
                f"the linear-attention state cannot return to position {start}: a cache rolls "
                f"back only within its last pass (positions {sorted(saved)})"
            )
        return saved[start]

    def _convolve(self, projected, previous):
        """Causal depthwise convolution + SiLU of [B, T, C] after the previous inputs
        [B, C, k_conv - 1]; returns the outputs [B, T, C] and the conv state after each
        position 0..T (as a list)."""
        width = self.conv.shape[1]
        inputs = torch.cat((previous, projected.transpose(1, 2)), dim=-1)  # [B, C, k - 1 + T]
        windows = inputs.unfold(-1, width, 1)  # [B, C, T, k]: the inputs each output sees
        out = F.silu((windows * self.conv[:, None, :]).sum(-1))  # [B, C, T]
        states = [inputs[:, :, t : t + width - 1] for t in range(projected.shape[1] + 1)]
        return out.transpose(1, 2).to(projected.dtype), states

    def _recur(self, q, k, v, beta, decay, state, keep: set[int]):
        """The gated delta rule over the pass's tokens: outputs [B, T, V, d_v] (float32)
        and {position: S after it} for the positions in `keep` (0..T)."""
        batch, tokens, _ = q.shape
        group = self.value_heads // self.key_heads  # each key head serves `group` value heads
        q, k = (
            t.float().view(batch, tokens, self.key_heads, self.key_dim).repeat_interleave(group, 2)
            for t in (q, k)
        )
        q = q * (q * q).sum(-1, keepdim=True).add(L2_EPS).rsqrt() * self.key_dim**-0.5
        k = k * (k * k).sum(-1, keepdim=True).add(L2_EPS).rsqrt()
        v = v.float().view(batch, tokens, self.value_heads, self.value_dim)
        states, outputs = {0: state}, []
        for t in range(tokens):
            state = state * decay[:, t].exp()[..., None, None]  # [B, V, d_k, d_v]
            remembered = (state * k[:, t, :, :, None]).sum(-2)  # [B, V, d_v]
            delta = (v[:, t] - remembered) * beta[:, t, :, None]
            state = state + k[:, t, :, :, None] * delta[:, :, None, :]
            outputs.append((state * q[:, t, :, :, None]).sum(-2))
            if t + 1 in keep:
                states[t + 1] = state
        return torch.stack(outputs, dim=1), states
