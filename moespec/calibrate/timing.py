"""Timing one operation honestly on a CPU: warm up, flush the caches, repeat, keep every sample."""

import statistics
import time
from collections.abc import Callable

import torch

FLUSH_BYTES = 256 * 2**20  # larger than the last-level cache of the machines we target


class CacheFlusher:
    """Touches a buffer larger than the last-level cache, so the next run reads from memory."""

    def __init__(self, nbytes: int = FLUSH_BYTES):
        self.buffer = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32)

    def __call__(self) -> None:
        self.buffer.add_(1.0)


def time_runs(
    fn: Callable[[], object],
    *,
    repeats: int,
    warmup: int = 2,
    flush: Callable[[], None] | None = None,
) -> list[float]:
    """Seconds of each of `repeats` runs of fn(), each after a cache flush (if given)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if flush is not None:
            flush()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def quartiles(samples: list[float]) -> tuple[float, float, float]:
    """(Q1, median, Q3) of the samples (inclusive method); one sample is all three."""
    if len(samples) < 2:
        return samples[0], samples[0], samples[0]
    q1, q2, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return q1, q2, q3


def median_iqr(samples: list[float]) -> tuple[float, float]:
    """(median, interquartile range) of the samples."""
    q1, _, q3 = quartiles(samples)
    return statistics.median(samples), q3 - q1


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """This machine's memory read bandwidth in bytes/s: the best of summing a large buffer."""
    buffer = torch.ones(nbytes // 4, dtype=torch.float32)
    samples = time_runs(lambda: buffer.sum(), repeats=repeats, warmup=1)
    return nbytes / min(samples)
