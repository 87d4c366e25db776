"""Batch invariance: every row of a pass of n tokens gets the bits it would get alone.

In bf16 a verification pass of k + 1 tokens can round differently from k + 1 passes of one
token: the library picks kernels (and reduction splits) by the number of rows, and a masked
attention over L keys splits L differently from an unmasked one over the first keys only.
Greedy speculation then leaves the plain greedy path at a near-tie. Inside
`batch_invariance(True)`:

- a product of n rows runs in chunks of at most `invariant_rows(weight)` rows: on weights
  packed for oneDNN or held in int8, the largest chunk for which this CPU and thread count
  give each row the bits of a one-row product (probed once per shape); on any other weight,
  one row at a time;
- the threads of a product follow its weight alone, not its rows (`moespec.kernels.threads`);
- attention of a pass attends row by row, each query over exactly the keys it sees, as a
  one-token pass does (`moespec.models.layers.attend`);
- the expert kernels combine each token's m slots in slot order, whatever the pass.

Norms, the router's softmax and top-k, and SwiGLU are row-wise already.
"""

import contextlib
import threading

import torch

MAX_PASS = 9  # the largest verification pass probed (k_max = 8)

_state = threading.local()
_chunks: dict[tuple, int] = {}


def is_batch_invariant() -> bool:
    return getattr(_state, "on", False)


@contextlib.contextmanager
def batch_invariance(on: bool = True):
    """Run the block's products, attention and expert combines batch-invariantly (or not)."""
    previous = is_batch_invariant()
    _state.on = on
    try:
        yield
    finally:
        _state.on = previous


def invariant_rows(weight, product, variant=None) -> int:
    """The largest c <= MAX_PASS such that `product(x[:n], weight)` equals the one-row
    products row for row, bit for bit, for every n <= c, on random inputs (cached per shape,
    dtype, layout, thread count and `variant`, e.g. whether a bias is added).

    Only weights in the packed layout and int8 weights are probed: there a kernel that
    changes with the rows shows on the first input (int8: each output is one dot product over
    the input whose order does not depend on the rows in PyTorch's kernel, checked here).
    The library's default path can change its reduction with the rows and yet round the same
    on hundreds of random inputs (seen on a [16, 256] router), so its products always run
    one row at a time (c = 1), which is exact by construction."""
    if isinstance(weight, torch.Tensor):  # the library's default path (not packed, not int8)
        return 1
    layout = type(weight).__name__
    key = (tuple(weight.shape), weight.dtype, layout, torch.get_num_threads(), variant)
    if key not in _chunks:
        _chunks[key] = _probe(weight, product)
    return _chunks[key]


def _probe(weight, product) -> int:
    generator = torch.Generator().manual_seed(0)
    trials = min(64, max(8, -(-20000 // (MAX_PASS * weight.shape[0]))))  # >= 20k outputs
    chunk = MAX_PASS
    for _ in range(trials):
        x = torch.randn(MAX_PASS, weight.shape[1], generator=generator).to(weight.dtype)
        alone = torch.cat([product(x[i : i + 1], weight) for i in range(MAX_PASS)])
        for n in range(2, chunk + 1):
            if not torch.equal(product(x[:n], weight), alone[:n]):
                chunk = n - 1
                break
        if chunk == 1:
            break
    return chunk


def chunked(x: torch.Tensor, weight, product, variant=None) -> torch.Tensor:
    """product(x, weight) with x's rows in chunks of invariant_rows(weight)."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    chunk = invariant_rows(weight, product, variant)
    if rows.shape[0] <= chunk:
        return product(x, weight)
    out = torch.cat([product(part, weight) for part in rows.split(chunk)])
    return out.view(*shape[:-1], out.shape[-1])
