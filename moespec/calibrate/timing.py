"""Timing one operation honestly: warm up, flush the caches, repeat, keep every sample.

On the CPU a run is timed by the host's clock around the call. On a CUDA device it is timed by
CUDA events recorded on the stream around the run's kernels (the host only launches them), and
the flush is a write of a buffer larger than the L2 on the same stream; the host waits once,
after the last run.
"""

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

FLUSH_BYTES = 256 * 2**20  # larger than the last-level cache of the machines we target


def last_level_cache_bytes(cpu_dir: Path = Path("/sys/devices/system/cpu/cpu0/cache")):
    """The size of this CPU's last-level cache as Linux reports it (the highest level's data
    or unified cache), or None where it does not."""
    best = None
    for index in sorted(Path(cpu_dir).glob("index*")):
        try:
            level = int((index / "level").read_text())
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        if kind == "Instruction" or not size:
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        number = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        if best is None or level > best[0]:
            best = (level, number)
    return None if best is None else best[1]


def beyond_last_level_cache(nbytes: int) -> int:
    """nbytes, or twice this CPU's last-level cache where that is more: the size of a working
    set that streams from memory (some hosts report hundreds of MiB of last-level cache, where
    a set of tens of MiB is read from the cache)."""
    return max(nbytes, 2 * (last_level_cache_bytes() or 0))


class CacheFlusher:
    """Touches a buffer larger than the last-level cache (the L2 on a GPU), so the next run
    reads from memory."""

    def __init__(self, nbytes: int = FLUSH_BYTES, device="cpu"):
        self.buffer = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=device)

    def __call__(self) -> None:
        self.buffer.add_(1.0)


def time_runs(
    fn: Callable[[], object],
    *,
    repeats: int,
    warmup: int = 2,
    flush: Callable[[], None] | None = None,
    device="cpu",
) -> list[float]:
    """Seconds of each of `repeats` runs of fn(), each after a cache flush (if given), on
    `device` (the device fn's work runs on: "cpu", or a CUDA device timed by events)."""
    for _ in range(warmup):
        fn()
    if torch.device(device).type == "cuda":
        return _cuda_runs(fn, repeats, flush, device)
    samples = []
    for _ in range(repeats):
        if flush is not None:
            flush()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def _cuda_runs(fn, repeats: int, flush, device) -> list[float]:
    """Event-timed runs on the current stream of `device`; one host wait at the end."""
    with torch.cuda.device(device):
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(repeats)
        ]
        torch.cuda.synchronize()
        for start, end in events:
            if flush is not None:
                flush()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
    return [start.elapsed_time(end) * 1e-3 for start, end in events]


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


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5, device="cpu") -> float:
    """The memory read bandwidth of `device` in bytes/s, at this process's thread count: the
    best of `repeats` reads of a buffer of `nbytes` (far above the last-level cache).

    On an AVX2 CPU with the native library the read is `moespec.kernels.native.read_sum` (vector
    loads and adds only, each thread streaming one contiguous run, as the products read their
    weights); elsewhere, and on a GPU, it is PyTorch's sum of the buffer."""
    buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    read = lambda: buffer.sum()  # noqa: E731
    if buffer.device.type == "cpu":
        from moespec.kernels import native

        if native.has_read_probe():
            read = lambda: native.read_sum(buffer)  # noqa: E731
    samples = time_runs(read, repeats=repeats, warmup=1, device=device)
    return nbytes / min(samples)
