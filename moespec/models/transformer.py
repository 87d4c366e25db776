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


@dataclass
class Layer:
    input_norm: torch.Tensor
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

    @property
    def moe_blocks(self) -> dict[int, MoEBlock]:
        """{layer index: MoE block} for the MoE layers."""
        return {
            i: layer.mlp for i, layer in enumerate(self.layers) if isinstance(layer.mlp, MoEBlock)
        }

    def new_cache(self, batch: int = 1, capacity: int = 256) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, batch, c.num_kv_heads, c.head_dim, self.dtype, capacity)

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
        start = cache.length
        cache.reserve(length)
        with (
            batch_invariance(self.batch_invariant and batch * length <= MAX_PASS),
            pass_threads(self._attention_bytes(batch, start + length)),
        ):
            cos, sin = self.rotary.tables(start, length)
            mask = attention_mask(start, length, self.config.sliding_window)
            eps = self.config.rms_norm_eps
            h = F.embedding(tokens, self.embed)  # [B, T, H], a fresh tensor: added to in place
            for i, layer in enumerate(self.layers):
                h += layer.attention(rms_norm(h, layer.input_norm, eps), i, cache, cos, sin, mask)
                x = rms_norm(h, layer.post_attention_norm, eps)
                h += layer.mlp(x, kernel=kernel, layer=i, sink=routing_sink, offload=offload)
            cache.advance(length)
            if not all_logits and length > 1:
                h = h[:, -1:]
            return linear(rms_norm(h, self.norm, eps), self.lm_head).float()

    def _attention_bytes(self, batch: int, positions: int) -> int:
        """The keys and values one layer's attention reads: the size of a pass's largest
        operation besides its products (moespec.kernels.threads)."""
        c = self.config
        return 2 * batch * positions * c.num_kv_heads * c.head_dim * self.embed.element_size()

    def thread_plan(self, tokens: int = 1) -> dict:
        """Threads of a pass of `tokens` tokens at the current setting: the products that
        run on one thread and on all (moespec.kernels.threads), for reports."""
        available = torch.get_num_threads()
        products = [self.lm_head]
        for layer in self.layers:
            products += [layer.attention.qkv, layer.attention.o]
            if isinstance(layer.mlp, MoEBlock):
                products += list(layer.mlp.experts.weights(0)) * layer.mlp.top_k
            else:
                products += [layer.mlp.gate_up, layer.mlp.down]
        threads = [threads_for(w.nbytes * tokens, available) for w in products]
        return {
            "available": available,
            "small_work_bytes": SMALL_WORK_BYTES,
            "products_on_one_thread": sum(t == 1 for t in threads),
            "products_on_all_threads": sum(t > 1 for t in threads),
        }

    __call__ = forward

    def pack(self) -> "Transformer":
        """Re-lay every large weight out for the CPU's fastest library path (in place; same
        bytes, same results): attention, dense MLPs, the output head and every expert.
        A head tied to the embeddings is packed as a copy (the lookup needs the table)."""
        for layer in self.layers:
            a = layer.attention
            a.qkv, a.o = pack(a.qkv), pack(a.o)
            if isinstance(layer.mlp, MoEBlock):
                layer.mlp.router = pack(layer.mlp.router)
                layer.mlp.experts.pack()
            else:
                layer.mlp.gate_up, layer.mlp.down = pack(layer.mlp.gate_up), pack(layer.mlp.down)
        self.lm_head = pack(self.lm_head)
        return self

    def quantize_int8(self, dense: bool = True) -> "Transformer":
        """Every MoE layer's experts to int8 with per-output-channel scales (in place;
        moespec.kernels.quant); with `dense`, the attention projections, dense MLPs and the
        output head too. Routers, norms and the embedding table keep the dtype (a tied head
        is quantized as a copy: the lookup needs the table)."""
        for block in self.moe_blocks.values():
            block.experts.quantize_int8()
        if not dense:
            return self
        for layer in self.layers:
            a = layer.attention
            a.qkv, a.o = quantize_int8(dense_weight(a.qkv)), quantize_int8(dense_weight(a.o))
            if isinstance(layer.mlp, DenseMLP):
                mlp = layer.mlp
                mlp.gate_up = quantize_int8(dense_weight(mlp.gate_up))
                mlp.down = quantize_int8(dense_weight(mlp.down))
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
        """Bytes of the weights: all experts, and the dense bytes D every pass reads once
        (attention, norms, routers, dense MLPs, the output head; not the embedding table,
        of which a pass reads only its tokens' rows, unless it is tied to the head)."""
        experts = sum(
            b.experts.num_experts * b.experts.bytes_per_expert for b in self.moe_blocks.values()
        )
        tensors = [self.norm, self.lm_head]
        for layer in self.layers:
            a = layer.attention
            tensors += [layer.input_norm, layer.post_attention_norm, a.qkv, a.o]
            tensors += [t for t in (a.qkv_bias, a.o_bias, a.q_norm, a.k_norm) if t is not None]
            if isinstance(layer.mlp, MoEBlock):
                tensors.append(layer.mlp.router)
            else:
                tensors += [layer.mlp.gate_up, layer.mlp.down]
        return {"experts": experts, "dense": sum(t.nbytes for t in tensors)}
