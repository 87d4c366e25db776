"""The decoder: embeddings -> layers (attention, then MoE block or dense MLP) -> norm -> logits.

Batch size 1 is the first-class case; B > 1 works for equal-length rows sharing one cache
length. Inference only: weights are plain tensors, forward runs under `torch.inference_mode`.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moespec.kernels.invariance import MAX_PASS, batch_invariance
from moespec.kernels.linear import dense as dense_weight
from moespec.kernels.linear import linear, pack
from moespec.kernels.quant import quantize_int8
from moespec.kernels.threads import SMALL_WORK_BYTES, pass_threads, threads_for
from moespec.models.cache import KVCache
from moespec.models.config import ModelConfig
from moespec.models.layers import Attention, DenseMLP, Rotary, attention_mask, rms_norm
from moespec.models.moe import ExpertExecutor, MoEBlock, RoutingSink
from moespec.models.native_step import KERNELS as NATIVE_KERNELS
from moespec.models.native_step import MAX_TOKENS as NATIVE_MAX_TOKENS


@dataclass
class Layer:
    input_norm: torch.Tensor
    # or deepseek_v2.LatentAttention, deltanet.GatedDeltaNet: the same call and weights API
    attention: Attention
    post_attention_norm: torch.Tensor
    mlp: MoEBlock | DenseMLP


class Transformer:
    def __init__(self, config: ModelConfig, embed, layers: list[Layer], norm, lm_head, dtype):
        self.config = config
        self.embed = embed  # [V, H]
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head  # [V, H], the embeddings themselves when tied
        self.dtype = dtype
        self.rotary = Rotary(config, dtype)
        # Every row of a verification pass (up to MAX_PASS tokens) gets the bits it would get
        # alone (moespec.kernels.invariance): greedy speculation then equals plain greedy
        # decoding in bf16 too. Prompt passes are shared by both and stay as they are.
        self.batch_invariant = False
        # A compiled one-token step (moespec.models.compiled.capture); its bits are not the
        # eager pass's, so it never runs where batch invariance is asked for.
        self.captured_step = None
        # The native pass (moespec.models.native_step): every pass of batch 1 and at most
        # 256 tokens, plain or verifying, in one call. Built on first use; `native`
        # False keeps every pass eager (comparisons, tests).
        self.native = True
        self._native_step, self._native_note = None, None

    @property
    def moe_blocks(self) -> dict[int, MoEBlock]:
        """{layer index: MoE block} for the MoE layers."""
        return {
            i: layer.mlp for i, layer in enumerate(self.layers) if isinstance(layer.mlp, MoEBlock)
        }

    def new_cache(self, batch: int = 1, capacity: int = 256) -> KVCache:
        """The cache the attention keeps (keys and values, or MLA's compressed rows)."""
        # the first attention layer's: Gated DeltaNet layers keep their state beside it
        attention = next(x.attention for x in self.layers if hasattr(x.attention, "new_cache"))
        return attention.new_cache(self.config.num_layers, batch, self.dtype, capacity)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        *,
        kernel: str = "slot",
        all_logits: bool = False,
        routing_sink: RoutingSink | None = None,
        offload: ExpertExecutor | None = None,
    ) -> torch.Tensor:
        """Run a pass of T tokens after the cache's positions; return float32 logits
        [B, T, V] (all_logits) or [B, 1, V] (the last position only).

        kernel: the expert kernel of every MoE layer in this pass ("slot", "dedup", ...).
        routing_sink: called per MoE layer with the pass's expert ids and weights.
        offload: an executor that runs every MoE layer's experts from its own tiers,
        `offload(layer, x, expert_ids, expert_weights, kernel) -> y` (see moespec.offload);
        None: the experts held in memory by the model.
        """
        if tokens.dim() == 1:
            tokens = tokens[None]
        batch, length = tokens.shape
        step = self.native_for(length, kernel) if batch == 1 and offload is None else None
        if step is not None:
            return step(tokens, cache, kernel=kernel, all_logits=all_logits, sink=routing_sink)
        if (
            self.captured_step is not None
            and batch * length == 1
            and routing_sink is None
            and offload is None
            and not self.batch_invariant
        ):
            logits = self.captured_step(tokens.view(1), cache)
            if logits is not None:  # None: the compile failed, decode eagerly
                return logits
        start = cache.length
        cache.reserve(length)
        with (
            batch_invariance(self.batch_invariant and batch * length <= MAX_PASS),
            pass_threads(cache.layer_bytes(start + length)),
        ):
            cos, sin = self.rotary.tables(start, length)
            windows = self.config.attention_windows  # per layer: full or sliding attention
            masks = {w: attention_mask(start, length, w) for w in set(windows)}
            eps = self.config.rms_norm_eps
            h = F.embedding(tokens, self.embed)  # [B, T, H], a fresh tensor: added to in place
            for i, layer in enumerate(self.layers):
                x = rms_norm(h, layer.input_norm, eps)
                h += layer.attention(x, i, cache, cos, sin, masks[windows[i]])
                x = rms_norm(h, layer.post_attention_norm, eps)
                h += layer.mlp(x, kernel=kernel, layer=i, sink=routing_sink, offload=offload)
            cache.advance(length)
            if not all_logits and length > 1:
                h = h[:, -1:]
            return linear(rms_norm(h, self.norm, eps), self.lm_head).float()

    def warm_invariance(self, *, offloaded: bool = False) -> bool:
        """Take batch invariance's one-time probes now (`kernels.invariance.invariant_rows`, per
        weight shape and thread count: ~1.2 s for OLMoE-1B-7B's int8 projections and LM head on
        2 cores) rather than inside the first verification pass, whose time they would join.
        One scratch pass of MAX_PASS tokens on a scratch cache, the eager pass that verifies,
        with every routed expert skipped (an executor that returns zeros: no expert is read,
        so an offloaded model's files stay unread). Nothing to do where the model is not
        batch-invariant or, in memory, where its native pass verifies (its products are
        batch-invariant by construction, never probed). True where it ran the pass."""
        if not self.batch_invariant or (not offloaded and self.native_step() is not None):
            return False
        tokens = torch.zeros(MAX_PASS, dtype=torch.long, device=self.embed.device)
        self.forward(tokens, self.new_cache(capacity=MAX_PASS), all_logits=True, offload=no_experts)
        return True

    def native_step(self):
        """The native pass of this model (moespec.models.native_step), or None where it
        cannot run (`native_report` says why) or `native` is off."""
        if not self.native:
            return None
        if self._native_step is None and self._native_note is None:
            from moespec.models.native_step import NativeStep, unsupported

            self._native_note = unsupported(self)
            if self._native_note is None:
                self._native_step = NativeStep(self)
        return self._native_step

    def native_for(self, length: int, kernel: str):
        """The native pass that runs a pass of `length` tokens of one sequence with this
        expert kernel (no offload), or None where it runs otherwise (too long, a kernel the
        native pass does not compute, a captured one-token step that takes it)."""
        if length > NATIVE_MAX_TOKENS or kernel not in NATIVE_KERNELS:
            return None
        if length == 1 and self.captured_step is not None and not self.batch_invariant:
            return None
        return self.native_step()

    def native_report(self) -> dict:
        """{"native": whether passes of up to 256 tokens run natively, "note": why not}."""
        step = self.native_step()
        note = "off" if not self.native else self._native_note
        return {"native": step is not None, "note": note}

    def _weights_changed(self) -> None:
        self._native_step, self._native_note = None, None

    def thread_plan(self, tokens: int = 1) -> dict:
        """Threads of a pass of `tokens` tokens at the current setting: the products that
        run on one thread and on all (moespec.kernels.threads), for reports."""
        available = torch.get_num_threads()
        products = [self.lm_head]
        for layer in self.layers:
            products += layer.attention.products() + layer.mlp.products()
            if isinstance(layer.mlp, MoEBlock):
                products += list(layer.mlp.experts.weights(0)) * layer.mlp.top_k
        threads = [threads_for(w.nbytes * tokens, available) for w in products]
        return {
            "available": available,
            "small_work_bytes": SMALL_WORK_BYTES,
            "products_on_one_thread": sum(t == 1 for t in threads),
            "products_on_all_threads": sum(t > 1 for t in threads),
        }

    __call__ = forward

    def pack(self, experts: bool = True) -> "Transformer":
        """Re-lay every large weight out for the CPU's fastest library path (in place; same
        bytes, same results): attention, dense MLPs, the output head and, with `experts`,
        every expert (the offload engine keeps experts plain where it cannot copy their layout).
        A head tied to the embeddings is packed as a copy (the lookup needs the table)."""
        for layer in self.layers:
            pack_layer(layer, experts)
        self.lm_head = pack(self.lm_head)
        self._weights_changed()
        return self

    def quantize_int8(self, dense: bool = True) -> "Transformer":
        """Every MoE layer's experts to int8 with per-output-channel scales (in place;
        moespec.kernels.quant); with `dense`, the attention projections, dense MLPs and the
        output head too (latent attention and shared experts included). Routers, norms and
        the embedding table keep the dtype (a tied head is quantized as a copy: the lookup
        needs the table)."""
        self._weights_changed()
        for layer in self.layers:
            quantize_layer(layer, dense)
        if dense:
            self.lm_head = quantize_int8(dense_weight(self.lm_head))
        return self

    @property
    def expert_format(self) -> str | None:
        """The experts' weight format ("int8", "bf16", ...); None for a dense model."""
        blocks = list(self.moe_blocks.values())
        return blocks[0].experts.format if blocks else None

    @property
    def dense_format(self) -> str:
        """The format of the attention projections and the head: "int8" or the dtype's."""
        from moespec.kernels.cpu import format_name
        from moespec.kernels.quant import Int8Weight

        return "int8" if isinstance(self.lm_head, Int8Weight) else format_name(self.dtype)

    def parameter_bytes(self) -> dict[str, int]:
        """Bytes of the weights (seed 000's split of a pass's bytes): the routed experts,
        which a deduplicating kernel reads once per pass per distinct expert, and the dense
        bytes D every pass reads once whatever the routing (attention, norms, routers, shared
        experts, dense-layer MLPs, the output head; not the embedding table, of which a pass
        reads only its tokens' rows, unless it is tied to the head). `shared_experts` and
        `dense_mlp` are the parts of D that shared experts and dense layers' MLPs make."""
        experts = sum(
            b.experts.num_experts * b.experts.bytes_per_expert for b in self.moe_blocks.values()
        )
        tensors, shared, dense_mlp = [self.norm, self.lm_head], 0, 0
        for layer in self.layers:
            tensors += [layer.input_norm, layer.post_attention_norm, *layer.attention.tensors()]
            if isinstance(layer.mlp, MoEBlock):
                tensors += layer.mlp.dense_tensors()
                shared += sum(t.nbytes for t in layer.mlp.shared_tensors())
            else:
                tensors += layer.mlp.tensors()
                dense_mlp += sum(t.nbytes for t in layer.mlp.tensors())
        return {
            "experts": experts,
            "dense": sum(t.nbytes for t in tensors),
            "shared_experts": shared,
            "dense_mlp": dense_mlp,
        }

    def step_bytes(self) -> int:
        """Weight bytes a one-token pass reads: the dense bytes and top-k experts per MoE
        layer (seed 000's B(1) without the KV cache)."""
        experts = sum(b.top_k * b.experts.bytes_per_expert for b in self.moe_blocks.values())
        return self.parameter_bytes()["dense"] + experts


def no_experts(layer, x, expert_ids, expert_weights, kernel) -> torch.Tensor:
    """An expert executor that computes nothing: a pass of everything but the routed experts
    (`Transformer.warm_invariance`, the disk tier's dense timing)."""
    return torch.zeros_like(x)


def pack_layer(layer: Layer, experts: bool = True) -> None:
    """One layer's `Transformer.pack` (a loader finishes each layer before reading the next)."""
    layer.attention.pack()
    if isinstance(layer.mlp, MoEBlock):
        layer.mlp.pack(experts=experts)
    else:
        layer.mlp.pack()


def quantize_layer(layer: Layer, dense: bool = True) -> None:
    """One layer's `Transformer.quantize_int8`: its experts, and with `dense` its attention
    projections, dense MLP or shared experts."""
    if isinstance(layer.mlp, MoEBlock):
        layer.mlp.experts.quantize_int8()
    if not dense:
        return
    a = layer.attention  # Attention, or deepseek_v2.LatentAttention
    _quantize(a, ("qkv", "o") if isinstance(a, Attention) else ("q_a", "q", "kv_a", "o"))
    mlp = layer.mlp.shared if isinstance(layer.mlp, MoEBlock) else layer.mlp
    if mlp is not None:  # a dense layer's MLP or an MoE layer's shared experts
        _quantize(mlp, ("gate_up", "down"))


def _quantize(owner, names: tuple[str, ...]) -> None:
    """Each named weight of `owner` (absent ones skipped) to per-channel int8, in place."""
    for name in names:
        weight = getattr(owner, name)
        if weight is not None:
            setattr(owner, name, quantize_int8(dense_weight(weight)))
