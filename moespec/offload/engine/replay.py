"""Routing replay: each position of a sequence routed to the experts a trace names for it.

    replay = RoutingReplay(trace.expert_ids, trace.layer_indices, engine)  # offloaded
    replay = RoutingReplay(trace.expert_ids, trace.layer_indices, experts=model)  # in memory
    records = list(generate(model, prompt, max_tokens=64, offload=replay))

A random-weight checkpoint's routers have no locality, so its own routing says nothing of how
an expert cache does on a trained model. A replay keeps the model's passes (attention, router,
the router's weights of each token's m slots) and swaps the expert ids a router chose for the
trace's at the same position, before the experts run: the offload engine then sees the trace's
locality, and the in-memory run of the same replay is its reference (same kernels, same ids).
The model layer is untouched: the replay is an expert executor (`models.moe.ExpertExecutor`)
wrapped around the engine's, bracketed by the same begin_step/end_step.

Positions follow the brackets: a prompt chunk of n tokens takes the next n positions; a
decode pass of k + 1 tokens (the current token and k drafts) takes positions p..p+k, and the
next pass starts at p + accepted + 1, since the rejected drafts are rolled back and their
positions verified again. A wrong draft is routed as the trace's token at its position.
"""

import numpy as np
import torch

from moespec.kernels import get_kernel


class RoutingReplay:
    """Expert ids [T, L, m] of a trace forced on positions 0..T-1 of one sequence.

    layer_indices: the decoder layer of each of the trace's L MoE layers (the model's);
    inner: the executor that runs the experts (an OffloadEngine), or None with `experts`:
    a model (its MoE blocks' experts run by the in-memory kernel, as the block itself runs them).
    """

    def __init__(self, expert_ids, layer_indices, inner=None, *, experts=None):
        ids = np.asarray(expert_ids)
        if ids.ndim != 3 or ids.shape[1] != len(layer_indices):
            raise ValueError(
                f"the replay's expert ids must be [tokens, {len(layer_indices)} layers, m], "
                f"got shape {list(ids.shape)}"
            )
        if (inner is None) == (experts is None):
            raise ValueError("a routing replay runs its experts through inner or experts, one")
        self.expert_ids = torch.from_numpy(ids.astype(np.int64))  # [T, L, m]
        self.ordinal = {layer: i for i, layer in enumerate(layer_indices)}
        self.inner = inner
        self.blocks = None if experts is None else experts.moe_blocks
        if self.blocks is not None and sorted(self.blocks) != sorted(self.ordinal):
            raise ValueError(
                f"the replay's MoE layers {sorted(self.ordinal)} are not the model's "
                f"{sorted(self.blocks)}"
            )
        self.position = 0  # of the first token of the pass in flight (or the next one)
        self._pass = None  # (tokens, whether a prompt chunk) of the pass in flight

    @property
    def num_tokens(self) -> int:
        return self.expert_ids.shape[0]

    def begin_step(self, n_tokens: int, *, prefill: bool = False, **step) -> None:
        end = self.position + n_tokens
        if end > self.num_tokens:
            raise ValueError(
                f"the routing replay holds {self.num_tokens} positions; a pass reaches {end}"
            )
        self._pass = (n_tokens, prefill)
        if self.inner is not None:
            self.inner.begin_step(n_tokens, prefill=prefill, **step)

    def end_step(self, accepted: int) -> None:
        if self.inner is not None:
            self.inner.end_step(accepted)
        if self._pass is None:
            raise RuntimeError("end_step() without begin_step()")
        # a prompt chunk keeps all its positions; a decode pass its current token and the
        # accepted drafts
        tokens, prefill = self._pass
        self.position += tokens if prefill else accepted + 1
        self._pass = None

    def __call__(self, layer: int, x, expert_ids, expert_weights, kernel: str):
        """y [T, H]: the layer's experts of the trace's positions for x [T, H]."""
        rows = expert_ids.shape[0]
        if self._pass is None or rows != self._pass[0]:
            raise RuntimeError("begin_step(n) before a pass of n tokens through the replay")
        forced = self.expert_ids[self.position : self.position + rows, self.ordinal[layer]]
        forced = forced.to(expert_ids.device)  # [T, m]
        if self.inner is not None:
            return self.inner(layer, x, forced, expert_weights, kernel)
        return get_kernel(kernel)(x, forced, expert_weights, self.blocks[layer].experts)

    def take_stats(self) -> dict:
        return self.inner.take_stats() if self.inner is not None else {}

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
