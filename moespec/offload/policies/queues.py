"""The Asynchronous Execution Engine's two structures (seed 003 §3.4, App. D).

`PrefetchQueue`: a multi-level priority queue, one FIFO per utility level; the link takes the
highest non-empty level first (K down to tau), and within a level requests leave in the order
they came, which is layer order. Cancelling a layer's requests is lazy: entries are checked
against `queued` when popped.

`EvictionPool`: every cached expert indexed by its utility, one insertion-ordered bucket per
level (least recently used first within a level). Updates are O(1) (a dict delete and insert,
better than the paper's O(log N)); choosing a victim scans levels from 0 upward and skips the
experts that cannot leave now (in use or arriving), so it costs O(K + skipped).
"""

from collections import deque
from itertools import accumulate

import numpy as np


class PrefetchQueue:
    def __init__(self, num_layers: int, num_experts: int, max_utility: int):
        self.levels = [deque() for _ in range(max_utility + 1)]  # index = utility
        # queued[l][e]: the level of (l, e)'s live request, or -1 (Python lists: the queue is
        # touched per expert on every layer of a pass, where numpy's scalar access costs more)
        self.queued = [[-1] * num_experts for _ in range(num_layers)]
        self.by_layer = [set() for _ in range(num_layers)]

    def push(self, layer: int, expert: int, level: int) -> None:
        row = self.queued[layer]
        if row[expert] == level:
            return
        row[expert] = level  # an older entry at another level becomes stale
        self.levels[level].append((layer, expert))
        self.by_layer[layer].add(expert)

    def push_many(self, layer: int, experts, levels) -> None:
        """push(layer, e, level) for each pair, in order (lists of ints)."""
        row, pending, fifos = self.queued[layer], self.by_layer[layer], self.levels
        for expert, level in zip(experts, levels, strict=True):
            if row[expert] != level:
                row[expert] = level
                fifos[level].append((layer, expert))
                pending.add(expert)

    def pop(self) -> tuple[int, int] | None:
        for level in range(len(self.levels) - 1, -1, -1):
            fifo = self.levels[level]
            while fifo:
                layer, expert = fifo.popleft()
                if self.queued[layer][expert] == level:
                    self.queued[layer][expert] = -1
                    self.by_layer[layer].discard(expert)
                    return layer, expert
        return None

    def cancel_layer(self, layer: int) -> int:
        """Drop the requests of `layer` not yet started; return how many."""
        experts = self.by_layer[layer]
        cancelled = len(experts)
        if cancelled:
            row = self.queued[layer]
            for expert in experts:
                row[expert] = -1
            experts.clear()
        return cancelled

    def __len__(self) -> int:
        return sum(len(s) for s in self.by_layer)


class EvictionPool:
    def __init__(self, num_layers: int, num_experts: int, max_utility: int, expert_bytes):
        self.buckets = [dict() for _ in range(max_utility + 1)]  # index = utility
        self.level = [[-1] * num_experts for _ in range(num_layers)]  # [L][N]: level or -1
        self.expert_bytes = [int(b) for b in expert_bytes]
        self._bytes_at = [0] * (max_utility + 1)

    @property
    def bytes_at(self) -> np.ndarray:
        """Cached bytes per level [K + 1]."""
        return np.array(self._bytes_at, dtype=np.int64)

    def bytes_below(self) -> list[int]:
        """[K]: the cached bytes at levels below tau, for tau = 1..K."""
        return list(accumulate(self._bytes_at))[:-1]

    def add(self, layer: int, expert: int, level: int) -> None:
        self.level[layer][expert] = level
        self.buckets[level][(layer, expert)] = None
        self._bytes_at[level] += self.expert_bytes[layer]

    def remove(self, layer: int, expert: int) -> None:
        level = self.level[layer][expert]
        del self.buckets[level][(layer, expert)]
        self.level[layer][expert] = -1
        self._bytes_at[level] -= self.expert_bytes[layer]

    def move(self, layer: int, expert: int, level: int) -> None:
        """Re-key a cached expert at a new utility, or mark it used (same level: to the back)."""
        self.move_many(layer, (expert,), (level,))

    def move_many(self, layer: int, experts, levels) -> None:
        """move(layer, e, level) for each pair, in order (lists of ints)."""
        row, buckets, nbytes = self.level[layer], self.buckets, self.expert_bytes[layer]
        at = self._bytes_at
        for expert, level in zip(experts, levels, strict=True):
            key, old = (layer, expert), row[expert]
            del buckets[old][key]
            buckets[level][key] = None  # to the back: the most recently used of its level
            if old != level:
                row[expert] = level
                at[old] -= nbytes
                at[level] += nbytes

    def victim(self, below: int, can_leave) -> tuple[int, int] | None:
        """The least recently used expert of the lowest level < `below` that can leave now."""
        for level in range(min(below, len(self.buckets))):
            for key in self.buckets[level]:
                if can_leave(*key):
                    return key
        return None

    def __contains__(self, key) -> bool:
        layer, expert = key
        return self.level[layer][expert] >= 0
