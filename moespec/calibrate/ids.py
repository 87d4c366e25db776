"""Expert ids for the benchmark of the expert operation (seed 000 §2).

Chosen ids: for a pass of n tokens, the n m slots name exactly U distinct experts, from heavy
repetition (U = m: every token on the same experts) to none (U = min(N, n m)); each token's m
experts are distinct. Recorded windows: the ids of n consecutive tokens of a routing trace.
"""

import numpy as np


def chosen_ids(n_tokens: int, top_k: int, num_experts: int, distinct: int, rng) -> np.ndarray:
    """[n, m] ids naming exactly `distinct` experts, each row m distinct experts.

    Row t takes experts (t m + s) mod U of a random choice of U experts: rows are distinct
    within themselves because m <= U, and the n m >= U slots cycle through all U.
    """
    if not top_k <= distinct <= min(num_experts, n_tokens * top_k):
        raise ValueError(
            f"distinct experts must be in {top_k}..{min(num_experts, n_tokens * top_k)} "
            f"for n = {n_tokens}, m = {top_k}, N = {num_experts}; got {distinct}"
        )
    experts = rng.permutation(num_experts)[:distinct]
    slots = np.arange(n_tokens * top_k).reshape(n_tokens, top_k) % distinct
    return experts[slots]


def distinct_levels(n_tokens: int, top_k: int, num_experts: int, count: int) -> list[int]:
    """Up to `count` values of U spread evenly from m to min(N, n m), both ends included."""
    high = min(num_experts, n_tokens * top_k)
    if high == top_k:
        return [top_k]
    levels = np.linspace(top_k, high, num=min(count, high - top_k + 1))
    return sorted({int(round(u)) for u in levels})


def recorded_windows(
    expert_ids: np.ndarray, doc_starts: np.ndarray, n_tokens: int, count: int, rng
) -> np.ndarray:
    """[count, n, m] windows of n consecutive tokens of one layer, never crossing a document.

    expert_ids: [T, m] one layer's ids over the trace's tokens; doc_starts: [D + 1].
    """
    picks = window_starts(doc_starts, n_tokens, count, rng)
    return np.stack([expert_ids[s : s + n_tokens] for s in picks])


def window_starts(doc_starts: np.ndarray, n_tokens: int, count: int, rng) -> np.ndarray:
    """Up to `count` distinct first tokens of windows of n tokens inside documents, sorted."""
    starts = [
        np.arange(a, b - n_tokens + 1)
        for a, b in zip(doc_starts[:-1], doc_starts[1:], strict=True)
        if b - a >= n_tokens
    ]
    candidates = np.concatenate(starts) if starts else np.empty(0, dtype=np.int64)
    if len(candidates) == 0:
        raise ValueError(f"the trace has no window of {n_tokens} tokens inside a document")
    return np.sort(rng.choice(candidates, size=min(count, len(candidates)), replace=False))


def distinct_count(ids: np.ndarray) -> int:
    """X: the distinct experts a pass's ids name."""
    return len(np.unique(ids))


def requested_bytes(kernel: str, n_tokens: int, top_k: int, distinct: int, expert_bytes: int):
    """E_p(n), seed 000 §1: per-slot reads n m experts; every deduplicating kernel reads each
    of the pass's distinct experts once."""
    return (n_tokens * top_k if kernel == "slot" else distinct) * expert_bytes
