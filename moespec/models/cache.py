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
        start, new = self.length, keys.shape[2]
        stored_keys, stored_values = self.keys[layer], self.values[layer]
        stored_keys.narrow(2, start, new).copy_(keys)
        stored_values.narrow(2, start, new).copy_(values)
        return stored_keys.narrow(2, 0, start + new), stored_values.narrow(2, 0, start + new)

    def advance(self, new_tokens: int) -> None:
        self.length += new_tokens

    def rollback(self, length: int) -> None:
        """Keep the first `length` positions only."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: the cache holds {self.length}")
        self.length = length
