"""A routing trace: the experts every token of some documents selects, in every MoE layer.

In memory a trace is dense arrays over tokens T (documents concatenated in order), MoE layers L
and slots m:

    expert_ids[t, l, s]    int16/int32, the s-th expert token t selects in MoE layer l
    gate_weights[t, l, s]  float32 routing weights (optional)
    doc_starts[d]          index of document d's first token; doc_starts[-1] == T

Windows of consecutive tokens never cross a document boundary.
"""

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RoutingTrace:
    expert_ids: np.ndarray  # [T, L, m]
    doc_starts: np.ndarray  # [D + 1], 0 = doc_starts[0] < ... < doc_starts[D] = T
    doc_names: list[str]  # [D]
    num_experts: int  # N
    expert_bytes: list[int]  # w_l, bytes of one expert of each MoE layer
    layer_indices: list[int]  # the decoder layer of each MoE layer
    model: str = ""
    dtype: str = ""
    gate_weights: np.ndarray | None = None  # [T, L, m]
    metadata: dict = field(default_factory=dict)

    def __post_init__(self):
        ids = self.expert_ids
        if ids.ndim != 3:
            raise ValueError(f"expert_ids must be [tokens, layers, top_k], got shape {ids.shape}")
        tokens, layers, top_k = ids.shape
        starts = np.asarray(self.doc_starts, dtype=np.int64)
        if starts.ndim != 1 or len(starts) != len(self.doc_names) + 1:
            raise ValueError("doc_starts must have one entry per document plus the end")
        if starts[0] != 0 or starts[-1] != tokens or np.any(np.diff(starts) <= 0):
            raise ValueError("doc_starts must rise strictly from 0 to the number of tokens")
        if len(self.expert_bytes) != layers or len(self.layer_indices) != layers:
            raise ValueError(f"expert_bytes and layer_indices need one entry per layer ({layers})")
        if tokens and (ids.min() < 0 or ids.max() >= self.num_experts):
            raise ValueError(f"expert ids must lie in 0..{self.num_experts - 1}")
        if not 1 <= top_k < self.num_experts:
            raise ValueError(f"top_k must be in 1..{self.num_experts - 1}, got {top_k}")
        if self.gate_weights is not None and self.gate_weights.shape != ids.shape:
            raise ValueError("gate_weights must have the shape of expert_ids")
        self.doc_starts = starts

    @property
    def num_tokens(self) -> int:
        return self.expert_ids.shape[0]

    @property
    def num_layers(self) -> int:
        return self.expert_ids.shape[1]

    @property
    def top_k(self) -> int:
        return self.expert_ids.shape[2]

    @property
    def num_documents(self) -> int:
        return len(self.doc_names)

    def documents(self):
        """Yield (name, expert_ids [T_d, L, m]) per document."""
        for d, name in enumerate(self.doc_names):
            yield name, self.expert_ids[self.doc_starts[d] : self.doc_starts[d + 1]]

    def first_tokens(self, tokens: int, name: str = "fit") -> "RoutingTrace":
        """The first `tokens` tokens as a trace of one document (a fit split)."""
        weights = self.gate_weights
        return RoutingTrace(
            expert_ids=self.expert_ids[:tokens],
            doc_starts=[0, tokens],
            doc_names=[name],
            num_experts=self.num_experts,
            expert_bytes=list(self.expert_bytes),
            layer_indices=list(self.layer_indices),
            model=self.model,
            dtype=self.dtype,
            gate_weights=None if weights is None else weights[:tokens],
        )

    def select_documents(self, names) -> "RoutingTrace":
        """A trace of the named documents only, in the given order."""
        index = {name: d for d, name in enumerate(self.doc_names)}
        missing = [n for n in names if n not in index]
        if missing:
            raise ValueError(f"documents not in the trace: {missing[:5]}")
        pieces, weights, starts, kept = [], [], [0], []
        for name in names:
            d = index[name]
            a, b = self.doc_starts[d], self.doc_starts[d + 1]
            pieces.append(self.expert_ids[a:b])
            if self.gate_weights is not None:
                weights.append(self.gate_weights[a:b])
            starts.append(starts[-1] + (b - a))
            kept.append(name)
        return RoutingTrace(
            expert_ids=np.concatenate(pieces) if pieces else self.expert_ids[:0],
            doc_starts=np.array(starts),
            doc_names=kept,
            num_experts=self.num_experts,
            expert_bytes=list(self.expert_bytes),
            layer_indices=list(self.layer_indices),
            model=self.model,
            dtype=self.dtype,
            gate_weights=np.concatenate(weights) if weights else None,
            metadata=dict(self.metadata),
        )
