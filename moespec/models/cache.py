"""A key-value cache that grows, and rolls back when speculative drafts are rejected."""

import torch


class KVCache:
    """Per-layer keys and values [B, kv_heads, capacity, head_dim]; `length` positions are valid.

    A forward pass writes its T new positions at [length, length + T) in every layer, then
    `advance(T)`. `rollback(n)` forgets everything after position n (rejected drafts).
    """

    def __init__(self, num_layers, batch, kv_heads, head_dim, dtype, capacity=256):
        shape = (batch, kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def reserve(self, new_tokens: int) -> None:
        """Make room for `new_tokens` more positions (doubling, so growth is amortised)."""
        needed = self.length + new_tokens
        if needed <= self.capacity:
            return
        capacity = max(needed, 2 * self.capacity)
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                grown = old.new_zeros(*old.shape[:2], capacity, old.shape[3])
                grown[:, :, : self.length] = old[:, :, : self.length]
                store[i] = grown

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor):
        """Write this pass's keys/values [B, kv_heads, T, D]; return all valid ones incl. these."""
        return self._write(self.keys[layer], keys), self._write(self.values[layer], values)

    def _write(self, stored: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """new [B, heads, T, D] into stored at [length, length + T); the valid rows after."""
        stored.narrow(2, self.length, new.shape[2]).copy_(new)
        return stored.narrow(2, 0, self.length + new.shape[2])

    def layer_bytes(self, positions: int) -> int:
        """Bytes that one layer's attention reads over `positions` cached positions."""
        row = sum(t[0].numel() // t.shape[2] * t.element_size() for t in self._stores(0))
        return self.keys[0].shape[0] * positions * row

    def _stores(self, layer: int) -> list[torch.Tensor]:
        return [self.keys[layer], self.values[layer]]

    def advance(self, new_tokens: int) -> None:
        self.length += new_tokens

    def rollback(self, length: int) -> None:
        """Keep the first `length` positions only."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: the cache holds {self.length}")
        self.length = length


class LatentCache(KVCache):
    """Multi-head latent attention's compressed cache (DeepSeek-V2 §2.1): per layer one row
    per position, the normed latent c_KV and the rotated shared key k_R side by side
    [B, 1, capacity, d_c + d_R]; no per-head keys or values. Grows and rolls back as KVCache.
    """

    def __init__(self, num_layers, batch, width, dtype, capacity=256):
        shape = (batch, 1, capacity, width)
        self.keys = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.values = []  # nothing more to store (reserve() grows the keys alone)
        self.length = 0

    def update_rows(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """Write this pass's rows [B, 1, T, d_c + d_R]; return all valid ones incl. these."""
        return self._write(self.keys[layer], rows)

    def _stores(self, layer: int) -> list[torch.Tensor]:
        return [self.keys[layer]]
