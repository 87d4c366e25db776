"""A captured one-token decode step: the whole pass compiled once (`torch.compile`, Inductor).

A small model's decode step is nearly all fixed time: some 300 library calls, each a few
microseconds of Python and dispatch, for well under a millisecond of bytes. Compiled, the
step is one call into generated C++: elementwise work fused, no per-operation dispatch.

The position is a tensor and attention runs over the cache's whole capacity with the later
positions masked, so the graph compiles once per model and never per position; the capacity
is its one symbolic size (the weights' shapes stay static: a fully dynamic graph ran no
faster than eager). MoE routing for one token has no
data-dependent shapes: the top-k experts' weights are read by index inside the fused
product (no gathered copy). The step runs on one thread: it is used only where every
product of the step is below the size that earns a second one (moespec.kernels.threads).

Its bits are not the eager pass's (fused reductions round differently), so it serves passes
whose bits nothing else must reproduce: a draft model's steps, and a target's plain steps
when it is not batch-invariant (moespec.kernels.invariance).
"""

import os
import shutil
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from moespec.kernels import isa
from moespec.kernels.linear import dense
from moespec.kernels.threads import SMALL_WORK_BYTES, intra_op_threads

CompileMode = Literal["auto", "on", "off"]
COMPILE_CHOICES = ("auto", "on", "off")


@dataclass
class LayerWeights:
    """One layer's weights as ordinary tensors (T = 1 token, H = hidden)."""

    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(N + 2K) D, H]
    qk_norm: torch.Tensor | None  # [N + K, D]
    o: torch.Tensor  # [H, N D]
    post_attention_norm: torch.Tensor  # [H]
    router: torch.Tensor | None  # [E, H]; None: a dense MLP
    gate_up: torch.Tensor  # [E, 2I, H] experts, or [2I, H] dense
    down: torch.Tensor  # [E, H, I], or [H, I]


def supported(model) -> str | None:
    """Why the captured step cannot run this model, or None when it can."""
    c = model.config
    if c.qk_norm == "projection" or c.clip_qkv is not None:
        return "its q/k projection norms or clipping are not in the captured step"
    if c.sliding_window is not None:
        return "sliding-window attention is not in the captured step"
    if c.attention_bias:
        return "attention biases are not in the captured step"
    if model.dtype not in (torch.float32, torch.bfloat16):
        return f"{model.dtype} is not a dtype of the captured step"
    if "int8" in (model.expert_format, model.dense_format):
        return "int8 weights are not in the captured step"
    return None


def compiler_missing() -> str | None:
    """Why Inductor cannot compile here (no C++ compiler, or a lowered ATen dispatch), or None.

    With ATEN_CPU_CAPABILITY set below what the CPU has (e.g. avx2 on an AVX-512 host),
    torch 2.13's captured step gave wrong greedy tokens in fp32 where eager was right
    (tests/test_models_compiled.py under ATEN_CPU_CAPABILITY=avx2; ONEDNN_MAX_CPU_ISA alone
    does not): such a process decodes eagerly."""
    if not any(shutil.which(name) for name in ("g++", "c++", "clang++")):
        return "no C++ compiler found (g++, c++ or clang++)"
    if (lowered := os.environ.get("ATEN_CPU_CAPABILITY")) and dispatch_lowered():
        return f"ATEN_CPU_CAPABILITY={lowered} lowers the dispatch, where the step miscompiles"
    return None


def dispatch_lowered() -> bool:
    """Whether PyTorch dispatches below the CPU's AVX-512 or AVX2 (ATEN_CPU_CAPABILITY)."""
    capability, flags, _ = isa.this_cpu()
    if "avx512f" in flags:
        return capability not in ("AVX512", "AVX512_BF16", "AMX")
    return "avx2" in flags and capability not in ("AVX2", "AVX512")


def small_enough(model) -> bool:
    """Every product of a one-token step below SMALL_WORK_BYTES: eager runs it on one thread."""
    largest = max(w.nbytes for w in _products(model))
    return largest < SMALL_WORK_BYTES


def _products(model):
    yield model.lm_head
    for layer in model.layers:
        yield layer.attention.qkv
        yield layer.attention.o
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            yield mlp.router
            yield from mlp.experts.weights(0)
        else:
            yield from (mlp.gate_up, mlp.down)


def layer_weights(model) -> list[LayerWeights]:
    out = []
    for layer in model.layers:
        a, mlp = layer.attention, layer.mlp
        if hasattr(mlp, "experts"):
            e = mlp.experts
            pairs = [e.dense_weights(i) for i in range(e.num_experts)]
            router = dense(mlp.router)
            gate_up = torch.stack([g for g, _ in pairs])
            down = torch.stack([d for _, d in pairs])
        else:
            router, gate_up, down = None, dense(mlp.gate_up), dense(mlp.down)
        out.append(
            LayerWeights(
                layer.input_norm,
                dense(a.qkv),
                a.qk_norm_weight,
                dense(a.o),
                layer.post_attention_norm,
                router,
                gate_up,
                down,
            )
        )
    return out


def _rms_norm(x, weight, eps):
    h = x.float()
    h = h * torch.rsqrt((h * h).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _matvec(x, weight):
    """x [H] times weight [..., O, H] -> [..., O], accumulated in float32."""
    return (weight.float() * x.float()).sum(-1).to(x.dtype)


def capture(model, mode: CompileMode = "auto") -> dict:
    """Give `model` a captured one-token step by `mode` (its forward then takes it where it
    applies: one token, batch 1, no routing sink or offload, not batch-invariant).

    auto: on when the model is supported, small (every product of a step below
    SMALL_WORK_BYTES), a C++ compiler is present and the native pass
    (moespec.models.native_step) cannot run it; on: whatever its size; off: never.
    Never for a batch-invariant model (its one-token passes are the bits verification
    passes reproduce).
    Returns the report `compile_report(model)` gives."""
    if mode not in COMPILE_CHOICES:
        raise ValueError(f"compile mode must be one of {', '.join(COMPILE_CHOICES)}, got {mode!r}")
    model.captured_step, model.compile_note = None, None
    if mode == "off":
        model.compile_note = "off"
    elif model.batch_invariant:
        model.compile_note = "decoding eagerly: batch-invariant passes keep the eager bits"
    elif mode == "auto" and model.native_step() is not None:
        # measured on the demo target: 0.23 ms a step natively, 0.96 compiled, 1.7 eager
        model.compile_note = "decoding natively: the native pass runs every step"
    elif reason := supported(model) or compiler_missing():
        model.compile_note = f"decoding eagerly: {reason}"
    elif mode == "auto" and not small_enough(model):
        model.compile_note = "decoding eagerly: a product of the step earns more than one thread"
    else:
        model.captured_step = CompiledStep(model)
    model.compile_mode = mode
    return compile_report(model)


def compile_report(model) -> dict:
    """{"mode", "captured": whether one-token steps run compiled, "note": why not, or None}."""
    step = getattr(model, "captured_step", None)
    note = getattr(model, "compile_note", None)
    if step is not None and step.failure:
        note = f"decoding eagerly: the compile failed: {step.failure}"
    elif step is not None and model.batch_invariant:
        note = "decoding eagerly: batch-invariant passes keep the eager bits"
    return {
        "mode": getattr(model, "compile_mode", "off"),
        "captured": step is not None and not step.failure and not model.batch_invariant,
        "note": note,
    }


class CompiledStep:
    """`step(token, cache) -> logits [1, 1, V]` (float32) of one token at the cache's length.

    The cache is the model's own `KVCache` (batch 1); the step writes its position's keys
    and values and advances it, as `Transformer.forward` does. If the compile fails (the
    first call compiles), `failure` says why and every call returns None: run eagerly.
    """

    def __init__(self, model):
        c = model.config
        self.config = c
        self.embed = model.embed
        self.norm = model.norm
        self.lm_head = dense(model.lm_head)
        self.layers = layer_weights(model)
        self.rotary = model.rotary
        self.top_k = c.top_k
        self.renormalize = c.norm_topk_prob
        self.failure: str | None = None
        self.steps = 0  # steps run compiled
        self._compiled = torch.compile(self._forward, fullgraph=True)

    def __call__(self, token: torch.Tensor, cache) -> torch.Tensor | None:
        if self.failure:
            return None
        cache.reserve(1)
        cos, sin = self.rotary.tables(0, cache.capacity)
        position = torch.tensor([cache.length])
        if not self.steps:  # one graph for every capacity: only these sizes vary
            for t in (*cache.keys, *cache.values):
                torch._dynamo.mark_dynamic(t, 2)
            torch._dynamo.mark_dynamic(cos, 0)
            torch._dynamo.mark_dynamic(sin, 0)
        try:
            with intra_op_threads(1):
                logits = self._compiled(token, position, cache.keys, cache.values, cos, sin)
        except Exception as error:  # no working compiler, an unsupported platform, ...
            self.failure = (str(error).strip().splitlines() or [type(error).__name__])[0]
            return None
        cache.advance(1)
        self.steps += 1
        return logits

    def _forward(self, token, position, keys, values, cos, sin):
        # token, position: [1]; keys, values: per layer [1, K, C, D]; cos, sin: [P, 1, D]
        c = self.config
        eps = c.rms_norm_eps
        heads, kv_heads, dim = c.num_heads, c.num_kv_heads, c.head_dim
        cos, sin = cos[position, 0], sin[position, 0]  # [1, D]
        # attention over the whole capacity, the positions after this one masked out
        seen = torch.arange(keys[0].shape[2]) <= position  # [C]
        h = F.embedding(token, self.embed)[0]  # [H]
        for i, w in enumerate(self.layers):
            x = _rms_norm(h, w.input_norm, eps)
            qkv = _matvec(x, w.qkv).view(heads + 2 * kv_heads, dim)
            qk, v = qkv.split((heads + kv_heads, kv_heads))
            if w.qk_norm is not None:
                qk = _rms_norm(qk, w.qk_norm, eps)
            qk = qk * cos + qk.roll(dim // 2, -1) * sin
            q, k = qk.split((heads, kv_heads))
            keys[i][0].index_copy_(1, position, k[:, None])
            values[i][0].index_copy_(1, position, v[:, None])
            h = h + _matvec(_attend(q, keys[i][0], values[i][0], seen), w.o)
            x = _rms_norm(h, w.post_attention_norm, eps)
            h = h + (
                _experts(x, w, self.top_k, self.renormalize)
                if w.router is not None
                else _dense_mlp(x, w)
            )
        x = _rms_norm(h, self.norm, eps)
        return _matvec(x, self.lm_head).float().view(1, 1, -1)


def _attend(q, keys, values, seen):
    # q: [N, D]; keys, values: [K, C, D]; seen: [C] -> [N D]
    kv_heads, _, dim = keys.shape
    rows = q.view(kv_heads, -1, dim)  # [K, G, D]: heads k G + g share key head k
    scores = torch.matmul(rows.float(), keys.float().transpose(1, 2)) * dim**-0.5  # [K, G, C]
    probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
    return torch.matmul(probs, values.float()).to(q.dtype).reshape(-1)


def _dense_mlp(x, w):
    gate, up = _matvec(x, w.gate_up).chunk(2)
    return _matvec(F.silu(gate) * up, w.down)


def _experts(x, w, top_k, renormalize):
    # x: [H]; the m experts' weights read by index inside the products
    probs = torch.softmax(_matvec(x, w.router).float(), dim=-1)  # [E]
    weights, ids = torch.topk(probs, top_k)
    if renormalize:
        weights = weights / weights.sum()
    hidden = _matvec(x, w.gate_up[ids])  # [m, 2I]
    gate, up = hidden.chunk(2, dim=-1)
    act = F.silu(gate) * up  # [m, I]
    out = (w.down[ids].float() * act.float()[:, None, :]).sum(-1).to(x.dtype)  # [m, H]
    return (out * weights.to(x.dtype)[:, None]).sum(0)
