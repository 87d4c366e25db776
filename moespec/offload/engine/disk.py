"""The disk tier: experts left in a converted model's file, read with direct I/O into RAM slots.

    store = DiskStore.for_model(model)  # a model loaded from `moespec convert`'s directory
    engine = OffloadEngine.for_model(model, make_policy("spac"), budget, store=store)

The engine's driver, policies and link run over it unchanged: it has `tiers.ExpertStore`'s
interface (`layers`, `slot_pool`, `compute`, the byte counts), its slots are the expert cache,
and a copy into a slot is a read from the file.

    file      `weights.safetensors` of a converted directory: each expert's tensors (gate_up and
              down: plain, in the native pair layout, or int8 values and scales) at fixed byte
              ranges, found from the mapped model's own views (`SafetensorsFile.offset_of`).
              The dense weights stay mapped and resident, as in memory; the experts' mapped
              pages are never touched
    runs      an expert's tensors grouped into runs of pages they share, each read as its
              4096-aligned superset (whole, or in chunks of `chunk_bytes`), O_DIRECT where the
              file system takes it (else buffered, dropped from the page cache after:
              POSIX_FADV_DONTNEED)
    slots     one anonymous mapping (page-aligned, touched once) of S slots of `stride` bytes
              (the largest expert's runs): nothing is allocated per read. A slot's weights are
              views at its expert's offsets, set once its read has completed and been checked
    threads   the link reads `io_threads` experts at a time (on-demand fetches ahead of
              prefetches: `tiers.Link`); with `read_depth` > 1 their chunks are read that many
              at a time (a layer misses 2-3 experts: more requests in flight for a disk that
              wants them; off by default, as on a 2-core AVX2 host the chunks cut the stall
              by a third but their threads took as much from the compute:
              benchmarks/disk_tier_overlap.py); os.preadv releases the GIL
    overlap   the backend asks the executor to compute on arrival (`compute_on_arrival`): a
              layer's cached experts run while its misses are read, the misses once in, so
              the decode loop waits only for what has not arrived when it is needed
    checks    a checksum of each expert's bytes at its first read (`expert_checksum`: 64 bits,
              position-sensitive by page, at memory speed), compared at every later one, and
              the file's size and mtime at every read: a file that changed is a one-line error
              naming the file and the expert, never a wrong token

The CPU tier (a policy's CPU experts, fetches that found no room, the prompt before the engine
starts) has no copy in memory to compute from: it reads its experts into a staging area of
top_k experts, a group at a time, while the decode loop waits (`read_through_seconds`).

The budget (`disk_budget`): the expert cache's bytes, at least one layer's active experts
(top_k slots); by default this machine's available memory less the dense weights and a margin.
"""

import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
import torch

from moespec.errors import SettingError, setting
from moespec.kernels import ExpertWeights
from moespec.kernels.native import PairWeight
from moespec.kernels.quant import Int8Weight
from moespec.offload.engine.tiers import CopyJob, _WallTimer

PAGE = 4096  # O_DIRECT's alignment of offsets, lengths and buffers (the common block size)
MARGIN = 512 << 20  # what the default budget leaves free beside the dense weights
IO_THREADS = 4  # experts read at a time by the link
READ_DEPTH = 1  # chunk reads in flight for the experts being read (1: in the link thread)
CHUNK_BYTES = None  # an expert's runs are read in chunks of this size (None: whole)


class DiskTierError(OSError):
    """A read of the disk tier that failed or found other bytes than before (one line)."""


def _tensors(weight) -> list[torch.Tensor]:
    """The tensors holding one expert matrix's bytes, in a fixed order."""
    if isinstance(weight, torch.Tensor):
        return [weight]
    if isinstance(weight, PairWeight):
        return [weight.packed]
    if isinstance(weight, Int8Weight):
        return [weight.values if weight.pairs is None else weight.pairs, weight.scales]
    raise ValueError(
        f"the experts are held as {type(weight).__name__}, a layout the disk tier does not "
        "read (plain, native pairs or int8 as converted): load the model without packing "
        "its experts"
    )


def _rebuilt(like, tensors: list[torch.Tensor]):
    """An expert matrix of `like`'s kind over `tensors` (views of a slot)."""
    if isinstance(like, torch.Tensor):
        return tensors[0]
    if isinstance(like, PairWeight):
        return like.holding(tensors[0])
    if like.pairs is None:
        return Int8Weight(tensors[0], tensors[1])
    return Int8Weight.paired_from(tensors[0], tensors[1], like.shape)


def _runs(ranges: list[tuple[int, int]]) -> tuple[list[tuple], list[int], int]:
    """(runs [(file start, length, slot offset, bytes needed)], each tensor's slot offset,
    the slot bytes) of tensors at file `ranges` [(start, nbytes)]: tensors sharing a page are
    read in one run, each run as its page-aligned superset, laid out in a slot one after
    another."""
    order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
    groups = []
    for i in order:
        start, end = ranges[i][0], ranges[i][0] + ranges[i][1]
        if groups and start // PAGE * PAGE <= groups[-1][1]:
            groups[-1][1] = max(groups[-1][1], -(-end // PAGE) * PAGE)
            groups[-1][2].append(i)
        else:
            groups.append([start // PAGE * PAGE, -(-end // PAGE) * PAGE, [i]])
    runs, places, offset = [], [0] * len(ranges), 0
    for begin, end, members in groups:
        needed = max(ranges[i][0] + ranges[i][1] for i in members) - begin
        runs.append((begin, end - begin, offset, needed))
        for i in members:
            places[i] = offset + ranges[i][0] - begin
        offset += end - begin
    return runs, places, offset


class DiskLayout:
    """Where every expert of a mapped converted model lies in its file (see the docstring).

    runs[l][e] and places[l][e]: `_runs` of expert e of MoE layer l; specs: each tensor's
    (dtype, shape), the same for every expert; stride: the slot bytes of the largest expert.
    """

    def __init__(self, model):
        weights_file = getattr(model, "weights_file", None)
        if weights_file is None:
            raise ValueError(
                f"{model.config.name}: the disk tier reads a converted model's file: convert "
                "the checkpoint first (`moespec convert`) and load that directory"
            )
        blocks = model.moe_blocks
        if not blocks:
            raise ValueError(f"{model.config.name}: the model has no MoE layer to offload")
        self.path, self.file_size = weights_file.path, weights_file.size
        self.layer_indices = sorted(blocks)
        self.layers = [blocks[i].experts for i in self.layer_indices]
        self.top_k = blocks[self.layer_indices[0]].top_k
        first = self.layers[0]
        self.num_experts = first.num_experts
        if not all(w.is_plain_swiglu for w in self.layers):
            raise ValueError(
                "offloading runs plain SwiGLU experts only: these have biases or a clamped "
                "SwiGLU (gpt-oss), which its expert slots do not hold"
            )
        self.like = first.weights(0)  # the kinds of an expert's two matrices
        self.split = len(_tensors(self.like[0]))  # gate_up's tensors come first
        self.specs = [(t.dtype, tuple(t.shape)) for t in self._expert_tensors(first, 0)]
        self.runs, self.places, self.stride, self.expert_bytes = [], [], 0, 0
        for l, experts in enumerate(self.layers):
            self.runs.append([])
            self.places.append([])
            for e in range(experts.num_experts):
                tensors = self._expert_tensors(experts, e)
                if [(t.dtype, tuple(t.shape)) for t in tensors] != self.specs:
                    raise ValueError(
                        f"expert {e} of layer {self.layer_indices[l]} has other tensors than "
                        "expert 0 of the first MoE layer: the disk tier's slots need them alike"
                    )
                ranges = [(self._offset(weights_file, t, l, e), t.nbytes) for t in tensors]
                runs, places, size = _runs(ranges)
                self.runs[-1].append(runs)
                self.places[-1].append(places)
                self.stride = max(self.stride, size)
        self.expert_bytes = sum(t.itemsize * int(np.prod(s)) for t, s in self.specs)

    def _expert_tensors(self, experts: ExpertWeights, e: int) -> list[torch.Tensor]:
        gate_up, down = experts.weights(e)
        return _tensors(gate_up) + _tensors(down)

    def _offset(self, weights_file, tensor: torch.Tensor, l: int, e: int) -> int:
        if not tensor.is_contiguous() or not weights_file.holds(tensor):
            raise ValueError(
                f"expert {e} of layer {self.layer_indices[l]} is not held in {self.path} "
                "(its weights were copied at load): load the model without packing its experts"
            )
        return weights_file.offset_of(tensor)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def all_expert_bytes(self) -> int:
        return self.num_layers * self.num_experts * self.expert_bytes

    @property
    def dense_bytes(self) -> int:
        """The file's bytes other than the experts': what stays mapped and resident."""
        return self.file_size - self.all_expert_bytes

    @property
    def least_budget(self) -> int:
        """One layer's active experts: top_k slots."""
        return self.top_k * self.stride

    def weights_at(self, memory: torch.Tensor, base: int, l: int, e: int):
        """(gate_up, down) of expert e of layer l, read into `memory` at byte `base`."""
        tensors = [
            memory[base + place : base + place + _nbytes(dtype, shape)].view(dtype).view(shape)
            for place, (dtype, shape) in zip(self.places[l][e], self.specs, strict=True)
        ]
        gate_up, down = self.like
        return _rebuilt(gate_up, tensors[: self.split]), _rebuilt(down, tensors[self.split :])


_MASK, _MIX = (1 << 64) - 1, 0x9E3779B97F4A7C15  # 64-bit words; an odd multiplier
# each 4 KiB page's weight in `expert_checksum`: fixed odd 64-bit numbers
_PAGE_WEIGHTS = np.random.default_rng(53).integers(0, 1 << 63, 1 << 16, dtype=np.uint64) * 2 + 1


def expert_checksum(data: memoryview) -> int:
    """A 64-bit checksum of `data` that moves with any change of its bytes or of their pages'
    order: each 4 KiB page's 64-bit words added (mod 2^64), the pages' sums weighted by fixed
    odd numbers, and the tail bytes. One numpy pass that releases the GIL, at memory speed (4x
    zlib.crc32 measured on 6 MB experts), so that the link's checks leave the CPU to the
    compute they overlap."""
    body = len(data) // 8
    words = np.frombuffer(data, dtype=np.uint64, count=body)  # [words]
    pages = np.add.reduceat(words, np.arange(0, body, PAGE // 8)) if body else words
    if len(pages) > len(_PAGE_WEIGHTS):
        raise ValueError(f"expert_checksum takes at most {len(_PAGE_WEIGHTS)} pages")
    total = int(np.dot(pages, _PAGE_WEIGHTS[: len(pages)]))
    tail = int.from_bytes(data[body * 8 :], "little")
    return (total * _MIX + tail + len(data)) & _MASK


def _chunks(length: int, chunk: int | None) -> list[tuple[int, int]]:
    """[(start, end)] of `length` bytes cut into reads of `chunk` bytes (the last shorter)."""
    if chunk is None:
        return [(0, length)]
    return [(at, min(at + chunk, length)) for at in range(0, length, chunk)]


def _nbytes(dtype, shape) -> int:
    return torch.empty((), dtype=dtype).element_size() * int(np.prod(shape))


class RamSlots:
    """S expert slots of `stride` bytes in one anonymous mapping (page-aligned), touched once;
    `weights` is the pool as one ExpertWeights whose matrix lists a read sets slot by slot
    (the engine's kernels index it by slot, as `tiers.SlotPool`'s)."""

    def __init__(self, slots: int, stride: int, like: ExpertWeights):
        self.slots, self.stride = slots, stride
        self.mapping = mmap.mmap(-1, max(slots * stride, PAGE))
        np.frombuffer(self.mapping, dtype=np.uint8)[::PAGE] = 0  # fault every page in now
        self.memory = torch.frombuffer(self.mapping, dtype=torch.uint8)
        self.view = memoryview(self.mapping)
        _, two_i, hidden = like.gate_up.shape
        self.weights = ExpertWeights(
            torch.empty((slots, two_i, hidden), dtype=like.dtype, device="meta"),
            torch.empty((slots, hidden, two_i // 2), dtype=like.dtype, device="meta"),
            packed_gate_up=[None] * slots,
            packed_down=[None] * slots,
        )
        self._free = list(range(slots - 1, -1, -1))

    def place(self, slot: int, matrices) -> None:
        self.weights.packed_gate_up[slot], self.weights.packed_down[slot] = matrices

    @property
    def used(self) -> int:
        return self.slots - len(self._free)

    def take(self) -> int:
        return self._free.pop()

    def release(self, slot: int) -> None:
        self.weights.packed_gate_up[slot] = self.weights.packed_down[slot] = None
        self._free.append(slot)


class DiskBackend:
    """The engine's backend for the disk tier: a copy is a read on a link thread."""

    name = "disk"
    device = torch.device("cpu")
    plain_slots = False

    def __init__(self, io_threads: int, on_arrival: bool = True):
        self.link_threads = io_threads
        self.compute_on_arrival = on_arrival  # the executor computes hits while reads run

    def copy(self, pool: RamSlots, job: CopyJob, source: "_DiskLayer") -> None:
        source.store.read(source.layer, job.expert, pool, job.slot)
        job.mark_issued()

    def wait(self, job: CopyJob) -> None:
        pass  # issued once its bytes are in the slot and checked

    def used(self, slots) -> None:
        pass

    def timer(self):
        return _WallTimer()


class _DiskLayer:
    """What the link copies from for one MoE layer (`ExpertStore.layers[l]`'s place)."""

    def __init__(self, store: "DiskStore", layer: int):
        self.store, self.layer = store, layer


class DiskStore:
    """Every expert, in the converted file: `read` fills a slot, `compute` is the CPU tier."""

    def __init__(
        self,
        layout: DiskLayout,
        *,
        io_threads: int = IO_THREADS,
        read_depth: int = READ_DEPTH,
        chunk_bytes: int | None = CHUNK_BYTES,
        on_arrival: bool = True,
    ):
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        if read_depth < 1:
            raise ValueError(f"read_depth must be >= 1, got {read_depth}")
        if chunk_bytes is not None and (chunk_bytes < PAGE or chunk_bytes % PAGE):
            raise ValueError(f"chunk_bytes must be a multiple of {PAGE} bytes, got {chunk_bytes}")
        self.layout, self.path = layout, layout.path
        self.backend = DiskBackend(io_threads, on_arrival)
        self.chunk_bytes = chunk_bytes
        self.num_layers, self.num_experts = layout.num_layers, layout.num_experts
        self.bytes_per_expert = layout.stride  # w: what a cached expert takes of the budget
        self.layers = [_DiskLayer(self, l) for l in range(self.num_layers)]
        self.fd, self.direct = _open(self.path)
        stat = os.fstat(self.fd)
        self.identity = (stat.st_size, stat.st_mtime_ns)
        if stat.st_size != layout.file_size:
            self.close()
            raise DiskTierError(
                f"{self.path} has {stat.st_size} bytes, {layout.file_size} when it was loaded: "
                "the file changed"
            )
        self.staging = RamSlots(layout.top_k, layout.stride, layout.layers[0])
        like = layout.layers[0]  # the shapes of a layer's stacked experts (meta)
        self._stacked = (like.gate_up.to("meta"), like.down.to("meta"))
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="moespec-disk-io")
        self._chunks = None  # one expert's chunks in flight together (depth 1: one at a time)
        if read_depth > 1:
            self._chunks = ThreadPoolExecutor(read_depth, thread_name_prefix="moespec-disk-chunk")
        self._lock = threading.Lock()  # guards the checksums and the counts
        self._checksum = np.zeros((self.num_layers, self.num_experts), dtype=np.uint64)
        self._seen = np.zeros((self.num_layers, self.num_experts), dtype=bool)
        self.bytes_read = self.reads = self.experts_read = 0
        self.read_seconds = self.read_through_seconds = 0.0

    @classmethod
    def for_model(cls, model, **options) -> "DiskStore":
        return cls(DiskLayout(model), **options)

    @property
    def total_bytes(self) -> int:
        return self.num_layers * self.num_experts * self.bytes_per_expert

    def slot_pool(self, slots: int, backend=None) -> RamSlots:
        return RamSlots(slots, self.layout.stride, self.layout.layers[0])

    # Reads.
    def read(self, l: int, e: int, slots: RamSlots, slot: int) -> None:
        """Expert e of MoE layer l into `slot`: read (its chunks in parallel), checked, then
        its weights set."""
        start, base = time.perf_counter(), slot * slots.stride
        chunks = [  # (run, file start, slot bytes)
            (run, file_start + at, slots.view[base + offset + at : base + offset + end])
            for run, (file_start, length, offset, _) in enumerate(self.layout.runs[l][e])
            for at, end in _chunks(length, self.chunk_bytes)
        ]
        if self._chunks is None or len(chunks) == 1:
            got = [self._pread(l, e, file_start, target) for _, file_start, target in chunks]
        else:
            got = self._parallel(l, e, chunks)
        runs = self.layout.runs[l][e]
        done, nbytes, calls = [0] * len(runs), 0, 0
        short = set()  # runs that ended early: what follows their short chunk is not theirs
        for (run, _, target), (count, tries) in zip(chunks, got, strict=True):
            if run not in short:
                done[run] += count
                if count < len(target):
                    short.add(run)
            nbytes, calls = nbytes + count, calls + tries
        for (file_start, length, _, needed), count in zip(runs, done, strict=True):
            if count < needed:
                raise DiskTierError(
                    f"{self.path} ended at byte {file_start + count} while reading "
                    f"{self._expert(l, e)} (it needs bytes up to {file_start + needed}): the "
                    "file was truncated"
                )
            if not self.direct:  # the RAM cache is the only copy kept
                os.posix_fadvise(self.fd, file_start, length, os.POSIX_FADV_DONTNEED)
        seconds = time.perf_counter() - start
        self._check(l, e, slots, base)
        slots.place(slot, self.layout.weights_at(slots.memory, base, l, e))
        with self._lock:
            self.bytes_read += nbytes
            self.reads += calls
            self.experts_read += 1
            self.read_seconds += seconds

    def _parallel(self, l: int, e: int, chunks: list) -> list[tuple[int, int]]:
        """`_pread` of every chunk, up to `read_depth` in flight; every one has finished
        (none still writes into the slot) before a failure is raised."""
        futures = [self._chunks.submit(self._pread, l, e, at, target) for _, at, target in chunks]
        wait(futures)
        for future in futures:
            if future.cancelled():  # closed while reading
                raise DiskTierError(f"{self.path}: closed while reading {self._expert(l, e)}")
        return [future.result() for future in futures]

    def _pread(self, l: int, e: int, file_start: int, target: memoryview) -> tuple[int, int]:
        """(bytes read, calls) of `target`'s bytes from `file_start`: fewer only at the end of
        the file."""
        done = calls = 0
        while done < len(target):
            try:
                got = os.preadv(self.fd, [target[done:]], file_start + done)
            except OSError as error:
                raise DiskTierError(
                    f"{self.path}: reading {self._expert(l, e)} at byte {file_start + done} "
                    f"failed: {error.strerror}"
                ) from None
            calls += 1
            done += max(got, 0)
            if got <= 0 or (self.direct and got % PAGE):
                break  # the end of the file
        return done, calls

    def _check(self, l: int, e: int, slots: RamSlots, base: int) -> None:
        """The file as it was opened, and the expert's bytes as at its first read."""
        stat = os.fstat(self.fd)
        if (stat.st_size, stat.st_mtime_ns) != self.identity:
            raise DiskTierError(
                f"{self.path} changed while in use ({stat.st_size} bytes, {self.identity[0]} "
                f"when opened; modified since): {self._expert(l, e)} cannot be trusted"
            )
        checksum = 0
        for place, (dtype, shape) in zip(self.layout.places[l][e], self.layout.specs, strict=True):
            start = base + place
            data = slots.view[start : start + _nbytes(dtype, shape)]
            checksum = (checksum * _MIX + expert_checksum(data)) & _MASK
        with self._lock:
            if not self._seen[l, e]:
                self._checksum[l, e], self._seen[l, e] = checksum, True
            elif self._checksum[l, e] != checksum:
                raise DiskTierError(
                    f"{self.path}: {self._expert(l, e)} read other bytes than at its first read "
                    f"(checksum {checksum:016x}, first {int(self._checksum[l, e]):016x}): the file "
                    "changed underneath"
                )

    def _expert(self, l: int, e: int) -> str:
        return f"expert {e} of layer {self.layout.layer_indices[l]}"

    # The CPU tier.
    def compute(self, kernel, l: int, x, expert_ids, expert_weights):
        """y [T, H] of layer l's experts read through the staging area: all at once where
        they fit (the in-memory kernel call), else a group at a time as rows of one expert
        each, every token's outputs added after (as the engine's split passes are)."""
        ids = expert_ids.numpy()  # [T, m]
        needed = np.unique(ids)
        group = self.staging.slots
        if len(needed) <= group:
            return kernel(x, expert_ids, expert_weights, self._stage(l, needed))
        rows, top_k = ids.shape
        flat = ids.reshape(-1)  # [T m], pair p = (token p // m, slot p % m)
        pair_ids, pair_weights = expert_ids.reshape(-1, 1), expert_weights.reshape(-1, 1)
        out = x.new_empty(rows * top_k, x.shape[1])  # [T m, H]
        for begin in range(0, len(needed), group):
            pairs = torch.from_numpy(np.flatnonzero(np.isin(flat, needed[begin : begin + group])))
            experts = self._stage(l, needed[begin : begin + group])
            out[pairs] = kernel(x[pairs // top_k], pair_ids[pairs], pair_weights[pairs], experts)
        return out.view(rows, top_k, -1).sum(dim=1)

    def _stage(self, l: int, experts: np.ndarray) -> ExpertWeights:
        """The layer's experts as an ExpertWeights holding only `experts` (read now)."""
        start = time.perf_counter()
        reads = [
            self._io.submit(self.read, l, int(e), self.staging, i) for i, e in enumerate(experts)
        ]
        for read in reads:
            read.result()
        with self._lock:
            self.read_through_seconds += time.perf_counter() - start
        gate_up, down = [None] * self.num_experts, [None] * self.num_experts
        for i, e in enumerate(experts.tolist()):
            gate_up[e] = self.staging.weights.packed_gate_up[i]
            down[e] = self.staging.weights.packed_down[i]
        return ExpertWeights(*self._stacked, packed_gate_up=gate_up, packed_down=down)

    def stats(self) -> dict:
        with self._lock:
            return {
                "tier": "disk",
                "file": str(self.path),
                "o_direct": self.direct,
                "disk_bytes_read": self.bytes_read,
                "disk_reads": self.reads,
                "experts_read": self.experts_read,
                "read_seconds": self.read_seconds,
                "read_through_seconds": self.read_through_seconds,
                "staging_bytes": self.staging.slots * self.staging.stride,
            }

    def close(self) -> None:
        """Stop the staging reads (those queued are dropped) and close the file."""
        for pool in (getattr(self, "_io", None), getattr(self, "_chunks", None)):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _open(path) -> tuple[int, bool]:
    """(descriptor, whether it reads with O_DIRECT): direct where the file system takes it
    (an aligned probe read succeeds), else buffered."""
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            fd = os.open(path, os.O_RDONLY | direct)
        except OSError:
            fd = None
        if fd is not None:
            probe = mmap.mmap(-1, PAGE)
            try:
                os.preadv(fd, [probe], 0)
                return fd, True
            except OSError:
                os.close(fd)
            finally:
                probe.close()
    try:
        return os.open(path, os.O_RDONLY), False
    except OSError as error:
        raise DiskTierError(f"{path} cannot be read: {error.strerror}") from None


def parse_size(text: str) -> int:
    """Bytes of "6G", "512M", "1.5G", "300K" or a plain count (binary units)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = str(text).strip().upper().removesuffix("B").removesuffix("I")
    scale = units.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in units else text
    try:
        value = float(number)
    except ValueError:
        raise SettingError(
            f"{setting('memory_budget')} takes a size such as 6G, 512M or a byte count, got "
            f"{text!r}"
        ) from None
    if value < 0:
        raise SettingError(f"{setting('memory_budget')} must be >= 0, got {text!r}")
    return int(value * scale)


def disk_budget(model, requested=None, *, available: int | None = None) -> tuple[int, str | None]:
    """(the expert cache's bytes, a note to print or None) for a `requested` size (bytes or
    a string of `parse_size`; None or "auto": available memory less the dense weights and
    `MARGIN`). Refused below one layer's active experts; capped, with a note, above what is
    available."""
    from moespec.models.memory import available_memory

    layout = DiskLayout(model)
    least = layout.least_budget
    room = (available_memory() if available is None else available) - layout.dense_bytes - MARGIN
    auto = requested is None or requested == "auto"
    asked = room if auto else parse_size(requested) if isinstance(requested, str) else requested
    if not auto and asked < least:
        raise SettingError(
            f"{setting('memory_budget', _size(asked))} holds less than one layer's active "
            f"experts: the least is {least} bytes ({_size(least)}: {layout.top_k} experts of "
            f"{layout.stride} bytes)"
        )
    if room < least:
        raise SettingError(
            f"this machine has {_size(room + layout.dense_bytes + MARGIN)} available: the disk "
            f"tier needs the dense weights ({_size(layout.dense_bytes)}), a margin of "
            f"{_size(MARGIN)} and one layer's active experts ({_size(least)})"
        )
    if auto:
        return room, (
            f"note: memory budget {_size(room)} for experts (available memory less the dense "
            f"weights' {_size(layout.dense_bytes)} and a margin of {_size(MARGIN)})"
        )
    if asked > room:
        return room, (
            f"warning: {setting('memory_budget', _size(asked))} is more than this machine has "
            f"for experts ({_size(room)} after the dense weights and a margin): using {_size(room)}"
        )
    return asked, None


def _size(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f}{unit}"
    return f"{nbytes}B"
