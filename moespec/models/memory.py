"""Memory you can see and set: what a model's weights and its KV cache will hold, what this
machine has, and a refusal before anything big is allocated when they do not fit.

    footprint = model_footprint("checkpoint/", "bf16", weights="int8")
    context = fit_memory(footprint, context=None, available=available_memory())

The weights' bytes are those of the final layouts (int8 values and scales, the pair layout's
padding, a packed copy of a tied head), counted on the same skeleton a converted model is
placed from (moespec.models.converted), before a byte is read; the cache's are per position,
from the model's own cache. Resident memory is read from /proc/self/status: the peak (VmHWM),
anonymous pages (what this process alone holds) and file pages (mapped weights, shared with
every process that maps the same converted file).
"""

import contextlib
import ctypes
import functools
import os
from dataclasses import dataclass
from pathlib import Path

from moespec.errors import SettingError, setting

# Room left beside weights and cache for activations, the interpreter and the libraries.
MARGIN_BYTES = 512 << 20
GB = 1e9


@dataclass(frozen=True)
class Footprint:
    """A model's memory before it is loaded: weights in their final layout, KV cache bytes
    per position, and the positions it was trained on."""

    weights_bytes: int
    cache_bytes_per_position: int
    max_positions: int
    weights: str  # "bf16", "int8", ... as it will run
    converted: bool

    def cache_bytes(self, positions: int) -> int:
        return self.cache_bytes_per_position * positions

    def to_dict(self) -> dict:
        return {
            "weights_bytes": self.weights_bytes,
            "cache_bytes_per_position": self.cache_bytes_per_position,
            "max_positions": self.max_positions,
            "weights": self.weights,
            "converted": self.converted,
        }


def model_footprint(path: str | Path, dtype=None, weights: str | None = None) -> Footprint:
    """The memory a load of `path` (a checkpoint or a converted directory) will take, from its
    index alone (no tensor is read)."""
    import torch

    from moespec.models import assemble, load_config, parse_dtype
    from moespec.models.checkpoint import TensorReader
    from moespec.models.converted import _stream, is_converted, read_manifest, skeleton_parts
    from moespec.models.tensorfile import DTYPES

    path = Path(path)
    converted = is_converted(path)
    if converted:
        manifest = read_manifest(path)
        index, dtype, weights = (
            manifest["source_tensors"],
            DTYPES[manifest["dtype"]],
            manifest["weights"],
        )
        weights = None if weights in ("bf16", "fp32") else weights
    else:
        index = TensorReader(path).source_tensors()
        dtype = parse_dtype(dtype or torch.bfloat16)
    config = load_config(path)
    parts = skeleton_parts(config, index, dtype, weights, path)
    total = sum(t.nbytes for _, t, _ in _stream(iter(parts.items())))
    cache = assemble(config, parts, dtype).new_cache(capacity=1)
    per_position = sum(t.nbytes for store in (cache.keys, cache.values) for t in store)
    kind = weights or {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype, str(dtype))
    return Footprint(total, per_position, int(config.max_position_embeddings), kind, converted)


def available_memory() -> int:
    """Bytes this machine can give a new allocation now (MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def process_memory() -> dict:
    """This process's resident memory now and at its peak, in bytes: peak_rss (VmHWM), rss,
    rss_anon (its own pages), rss_file (mapped files: weights shared with other processes)."""
    keys = {"VmHWM": "peak_rss", "VmRSS": "rss", "RssAnon": "rss_anon", "RssFile": "rss_file"}
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in keys:
                    out[keys[key]] = int(value.split()[0]) * 1024
    except OSError:
        import resource

        out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


@functools.cache
def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (glibc's malloc.h)


@contextlib.contextmanager
def loading_heap():
    """The heap while a model loads: every allocation from 1 MiB its own mapping, returned to
    the system when freed. A loader allocates and frees one expert's source after another;
    under glibc's default the first such frees raise the mapping threshold, later buffers
    come from the heap, and the process looked 0.4 GB larger per OLMoE layer (measured) than
    what it holds. Afterwards the thresholds are fixed where glibc's own adjustment ends
    (32 MiB, trimmed beyond 64 MiB), so decoding's temporaries are reused as before, and the
    free pages are handed back (malloc_trim)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        yield
        return
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(M_TRIM_THRESHOLD, 64 << 20)
        trim_heap()


def trim_heap() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


class MemoryRefusal(SettingError):
    """A model (or its context) that does not fit the memory available: refused before the
    weights are read."""


def fit_memory(footprint: Footprint, context: int | None, available: int, *, name: str) -> int:
    """The context (cache positions) to run with: `context` if weights and its cache fit in
    `available` (less a margin), else refused; None: the model's own positions, capped to
    what fits. A model whose weights alone do not fit is refused naming what would."""
    weights, room = footprint.weights_bytes, available - MARGIN_BYTES
    if weights > room:
        raise MemoryRefusal(
            f"{name} needs {weights / GB:.2f} GB for its {footprint.weights} weights and this "
            f"machine has {available / GB:.2f} GB available: {_advice(footprint)}"
        )
    per_position = max(footprint.cache_bytes_per_position, 1)
    fits = (room - weights) // per_position
    if context is None:
        return int(min(footprint.max_positions, fits))
    if context > footprint.max_positions:
        raise SettingError(
            f"{setting('context', context)} is beyond the model's {footprint.max_positions} "
            "positions (max_position_embeddings)"
        )
    if context > fits:
        raise MemoryRefusal(
            f"{name}: a context of {context} positions needs {context * per_position / GB:.2f} "
            f"GB of KV cache beside {weights / GB:.2f} GB of weights, and this machine has "
            f"{available / GB:.2f} GB available: pass {setting('context', int(fits))} or less"
        )
    return context


def _advice(footprint: Footprint) -> str:
    if footprint.weights in ("bf16", "fp32", "int8-experts"):
        return (
            f"run it with {setting('weights', 'int8')} (about half the bytes), on a machine "
            "with more memory, or with its experts offloaded to disk"
        )
    return "run it on a machine with more memory, or with its experts offloaded to disk"
