"""Intra-op threads chosen from the size of the work, so that more threads are never slower.

Forking a product or an attention over two threads costs a fixed few microseconds (and far
more when the other core is busy), which a small operation does not win back: a decode step
of a small model is nearly all such operations. Inside a model pass (`pass_threads`), each
product runs on one thread when its weight bytes times rows are below SMALL_WORK_BYTES and on
all the threads the caller allowed (`torch.get_num_threads()` at the pass's start) otherwise;
the pass's other operations follow the size of its attention over the cache the same way.
Outside a pass (kernel benchmarks, calibration) the library's own setting is left alone.
"""

import contextlib
import threading

import torch

# Measured on a 2-core machine (bf16 GEMVs streamed from memory): a second thread gains
# 1.2-1.5x on one product of 256 KiB-2 MiB when the other core is idle (at most ~60 us on the
# demo models' 2 MiB head) and loses 3-10x, milliseconds per step, when the other core is busy
# (its share of a barrier waits for the scheduler). From 4 MiB the gain is worth that risk.
SMALL_WORK_BYTES = 4 << 20

_state = threading.local()


def available_threads() -> int:
    """The threads the current pass may use (the library's setting outside a pass)."""
    return getattr(_state, "available", None) or torch.get_num_threads()


def threads_for(work_bytes: int, available: int | None = None) -> int:
    """One thread below SMALL_WORK_BYTES, else all that are available."""
    available = available_threads() if available is None else available
    return 1 if work_bytes < SMALL_WORK_BYTES else available


@contextlib.contextmanager
def intra_op_threads(n: int):
    """Run the block with n intra-op threads, restoring the previous setting after it."""
    previous = torch.get_num_threads()
    if n == previous:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@contextlib.contextmanager
def pass_threads(work_bytes: int):
    """A model pass: its products choose their own threads (`product_threads`); everything
    else runs with threads_for(work_bytes)."""
    available = torch.get_num_threads()
    outer = getattr(_state, "available", None)
    _state.available = outer or available
    try:
        with intra_op_threads(threads_for(work_bytes)):
            yield
    finally:
        _state.available = outer


def product_threads(weight_bytes: int, rows: int) -> int | None:
    """Threads for one product inside a pass; None outside a pass (leave the setting)."""
    available = getattr(_state, "available", None)
    if available is None or available == 1:
        return None
    return threads_for(weight_bytes * rows, available)
