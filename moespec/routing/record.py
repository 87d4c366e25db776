"""Recording routing: teacher-forced passes over documents, through the model's routing sink.

Each document runs through the model in chunks of `chunk_tokens` tokens, its KV cache carried
from chunk to chunk, so every token is routed exactly as in one long pass. A `RoutingRecorder`
(the sink) collects the m experts and gate weights of every token in every MoE layer; a document
is yielded only once all of its tokens are routed, so an interruption never leaves half of one.
"""

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from moespec.routing.corpus import Document
from moespec.routing.trace import RoutingTrace

CHUNK_TOKENS = 512
DTYPE_NAMES = {"torch.bfloat16": "bf16", "torch.float32": "fp32", "torch.float16": "fp16"}


@dataclass
class RecordedDocument:
    name: str
    expert_ids: np.ndarray  # [T_d, L, m]
    gate_weights: np.ndarray  # [T_d, L, m] float32


class RoutingRecorder:
    """A routing sink: sink(layer, expert_ids [T, m], expert_weights [T, m]) per MoE layer and
    pass. `take()` returns everything seen since the last take, as [T, L, m] arrays."""

    def __init__(self, layer_indices: Iterable[int], num_experts: int):
        self.layer_indices = list(layer_indices)
        self.slot = {layer: i for i, layer in enumerate(self.layer_indices)}
        self.id_dtype = np.int16 if num_experts <= 32768 else np.int32
        self._ids: list[list[np.ndarray]] = [[] for _ in self.layer_indices]
        self._weights: list[list[np.ndarray]] = [[] for _ in self.layer_indices]

    def __call__(self, layer: int, expert_ids, expert_weights) -> None:
        if layer not in self.slot:
            raise ValueError(f"routing from layer {layer}, which is not an MoE layer")
        i = self.slot[layer]
        self._ids[i].append(expert_ids.detach().cpu().numpy().astype(self.id_dtype))
        self._weights[i].append(expert_weights.detach().float().cpu().numpy())

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        tokens = {sum(len(a) for a in per_layer) for per_layer in self._ids}
        if len(tokens) != 1:
            raise RuntimeError(f"MoE layers saw different numbers of tokens: {sorted(tokens)}")
        ids = np.stack([np.concatenate(a) for a in self._ids], axis=1)  # [T, L, m]
        weights = np.stack([np.concatenate(a) for a in self._weights], axis=1)  # [T, L, m]
        self._ids = [[] for _ in self.layer_indices]
        self._weights = [[] for _ in self.layer_indices]
        return ids, weights


def tokenize_documents(
    tokenizer,
    documents: Iterable[Document],
    *,
    max_tokens: int | None = None,
    per_document: int | None = None,
) -> list[tuple[str, list[int]]]:
    """(name, token ids) per document, skipping documents with no tokens. With max_tokens,
    stop once that many tokens are taken; the last document is cut to fit. With
    per_document, each document is cut to its first that many tokens."""
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if per_document is not None and per_document < 1:
        raise ValueError(f"per_document must be >= 1, got {per_document}")
    result, total = [], 0
    for document in documents:
        ids = tokenizer.encode(document.text)[:per_document]
        if max_tokens is not None:
            ids = ids[: max_tokens - total]
        if ids:
            result.append((document.name, ids))
            total += len(ids)
        if max_tokens is not None and total >= max_tokens:
            break
    return result


def fit_documents(
    documents: Iterable[tuple[str, list[int]]], config, *, truncate: str = "none"
) -> list[tuple[str, list[int]]]:
    """(name, token ids) of documents that fit the model's context; a longer one is refused
    with one line (truncate "none"), or cut to its last ("left") or first ("right") tokens."""
    from moespec.errors import setting
    from moespec.models.context import fit_context

    fix = (
        f"pass {setting('truncate', 'right')} to keep its first {{keep}} tokens (or left: its last)"
    )
    return [
        (name, fit_context(ids, config, truncate=truncate, what=f"document {name!r}", fix=fix))
        for name, ids in documents
    ]


def record_routing(
    model,
    documents: Iterable[tuple[str, list[int]]],
    *,
    chunk_tokens: int = CHUNK_TOKENS,
    kernel: str = "dedup",
    on_tokens: Callable[[int], None] | None = None,
) -> Iterator[RecordedDocument]:
    """Route every token of every document; yield each document once it is complete.
    A document beyond the model's context is refused before any is routed."""
    import torch

    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    documents = fit_documents(documents, model.config)
    recorder = RoutingRecorder(model.moe_blocks, model.config.num_experts)
    for name, token_ids in documents:
        tokens = torch.tensor(token_ids, dtype=torch.long)
        cache = model.new_cache(capacity=len(token_ids))
        for start in range(0, len(token_ids), chunk_tokens):
            chunk = tokens[start : start + chunk_tokens]
            model(chunk, cache, kernel=kernel, routing_sink=recorder)
            if on_tokens is not None:
                on_tokens(len(chunk))
        ids, weights = recorder.take()
        yield RecordedDocument(name, ids, weights)


def model_header(model, metadata: dict | None = None) -> dict:
    """The trace header (see moespec.routing.store) of traces this model records."""
    blocks = model.moe_blocks
    if not blocks:
        raise ValueError(f"model {model.config.name!r} has no MoE layers to trace")
    return {
        "model": model.config.name,
        "num_layers": len(blocks),
        "num_experts": model.config.num_experts,
        "top_k": model.config.top_k,
        "expert_bytes": [block.experts.bytes_per_expert for block in blocks.values()],
        "layer_indices": list(blocks),
        "dtype": DTYPE_NAMES.get(str(model.dtype), str(model.dtype)),
        "metadata": dict(metadata or {}),
    }


def record_trace(
    model,
    tokenizer,
    documents: Iterable[Document],
    *,
    max_tokens: int | None = None,
    per_document: int | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
    truncate: str = "none",
) -> RoutingTrace:
    """An in-memory trace of the documents (for files, stream `record_routing` into a
    `TraceWriter` instead). max_tokens, per_document: see tokenize_documents. truncate: what
    to do with a document beyond the model's context (see fit_documents)."""
    header = model_header(model)
    tokenized = tokenize_documents(
        tokenizer, documents, max_tokens=max_tokens, per_document=per_document
    )
    recorded = list(
        record_routing(
            model,
            fit_documents(tokenized, model.config, truncate=truncate),
            chunk_tokens=chunk_tokens,
        )
    )
    if not recorded:
        raise ValueError("no document has any tokens")
    lengths = [len(r.expert_ids) for r in recorded]
    return RoutingTrace(
        expert_ids=np.concatenate([r.expert_ids for r in recorded]),
        doc_starts=np.concatenate([[0], np.cumsum(lengths)]),
        doc_names=[r.name for r in recorded],
        num_experts=header["num_experts"],
        expert_bytes=header["expert_bytes"],
        layer_indices=header["layer_indices"],
        model=header["model"],
        dtype=header["dtype"],
        gate_weights=np.concatenate([r.gate_weights for r in recorded]),
        metadata={"chunk_tokens": chunk_tokens},
    )
