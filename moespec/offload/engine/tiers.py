"""The two tiers of offloaded experts, and the link that copies between them.

    ExpertStore   every expert of every MoE layer in host memory (pinned when the device is CUDA)
    SlotPool      the expert cache on the compute device: S preallocated slots shared by all
                  MoE layers, gate_up [S, 2I, H] and down [S, H, I]; a cached expert is computed
                  in its slot (the kernels index the pool by slot), nothing is allocated per pass
    Link          one copy engine: a thread that copies experts from the store into slots, one at
                  a time, on-demand fetches ahead of prefetches, pulling prefetches whenever idle

Backends say what a copy is on a device. `CpuBackend`: the device is this CPU; the pool is
tensors of its own and a copy is a real `copy_` of the expert's bytes, so the same code runs
and is tested everywhere. There the store may hold its experts in the native pair layout
(`moespec.kernels.native.PairWeight`, what a model loaded with packing holds on a CPU whose
bf16 path is "native-pairs"): the pool's slots are pair-layout weights too, a copy moves the
same bytes, and both tiers run the in-memory engine's products (the pair loops ran 1.4-3.6x
the library's unpacked bf16 product at 1-9 rows on an AVX2 host, 2.65x at one row on an
AVX-512-BF16 one: benchmarks/cpu_paths.py). `CudaBackend`: the store pinned (in the pair
layout too where it is packed: the CPU tier reads it), plain slots (what the device kernels
read; a pair-layout expert is laid out plain on the device as it lands, `SlotPool.fill`),
copies on a copy stream, a CUDA event per copy (a kernel waits for it on the device, not on
the host) and per slot use (a copy into a reused slot waits for the last kernel that read it).

The budget rule is the layer driver's (`moespec.offload.driver.expert_cache_budget`).
"""

import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from moespec.kernels import ExpertWeights
from moespec.kernels.native import PairWeight, unpack_pairs_into


@dataclass(eq=False)
class CopyJob:
    """One expert copied from the store into a slot."""

    layer: int  # MoE layer ordinal
    expert: int
    slot: int
    kind: str  # "fetch", "prefetch" or "preload"
    event: object = None  # the backend's completion handle (a CUDA event)
    seconds: float = 0.0  # the copy's own duration (the link's busy time: Link.take_busy)

    def __post_init__(self):
        # Released once issued (a plain lock: jobs are many, an Event costs far more to make).
        self._gate = threading.Lock()
        self._gate.acquire()

    def mark_issued(self) -> None:
        self._gate.release()

    def wait_issued(self, timeout: float) -> bool:
        """Whether the copy was issued within `timeout` s (then `backend.wait` may follow)."""
        if not self._gate.acquire(timeout=timeout):
            return False
        self._gate.release()
        return True


class CpuBackend:
    """The compute device is this CPU; its "device memory" is the slot pool's own tensors."""

    name = "cpu"
    device = torch.device("cpu")
    plain_slots = False  # slots in the store's own layout (the pair layout where it is packed)

    def host(self, experts: ExpertWeights) -> ExpertWeights:
        return experts  # the model's own tensors are the store: nothing is duplicated

    def copy(self, pool: "SlotPool", job: CopyJob, source: ExpertWeights) -> None:
        with torch.no_grad():
            pool.fill(job.slot, source, job.expert)
        job.mark_issued()

    def wait(self, job: CopyJob) -> None:
        pass  # issued once the bytes are in the slot

    def used(self, slots) -> None:
        pass  # kernels on the CPU have finished when they return

    def timer(self):
        return _WallTimer()


class CudaBackend:
    """Copies on a stream of their own from pinned host memory, ordered by CUDA events."""

    name = "cuda"
    plain_slots = True  # the device kernels read plain [2I, H] and [H, I] slots

    def __init__(self, device: str = "cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"offload device {device!r}: CUDA is not available on this machine")
        self.device = torch.device(device)
        self.copy_stream = torch.cuda.Stream(self.device)
        self.last_use: dict[int, torch.cuda.Event] = {}  # slot -> event after its last kernel

    def host(self, experts: ExpertWeights) -> ExpertWeights:
        # Pinned pages let the copy engine read host memory directly (and asynchronously).
        if not experts.is_packed:
            return ExpertWeights(experts.gate_up.pin_memory(), experts.down.pin_memory())
        # The pair layout: the CPU tier's native products read it; a copy moves its bytes
        # and lays them out plain on the device (SlotPool.fill).
        return ExpertWeights(
            experts.gate_up,
            experts.down,
            packed_gate_up=[w.holding(w.packed.pin_memory()) for w in experts.packed_gate_up],
            packed_down=[w.holding(w.packed.pin_memory()) for w in experts.packed_down],
        )

    def copy(self, pool: "SlotPool", job: CopyJob, source: ExpertWeights) -> None:
        after = self.last_use.pop(job.slot, None)
        with torch.cuda.stream(self.copy_stream):
            if after is not None:
                self.copy_stream.wait_event(after)  # the slot's last reader has finished
            pool.fill(job.slot, source, job.expert, non_blocking=True)
            job.event = torch.cuda.Event()
            job.event.record(self.copy_stream)
        job.mark_issued()
        job.event.synchronize()  # the link thread waits: copies stay one at a time, timed

    def wait(self, job: CopyJob) -> None:
        """Once issued: the compute stream waits for the copy, the host does not."""
        torch.cuda.current_stream(self.device).wait_event(job.event)

    def used(self, slots) -> None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        for slot in slots:
            self.last_use[int(slot)] = event

    def timer(self):
        return _CudaTimer(self.device)


class _WallTimer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.elapsed = time.perf_counter() - self.start
        return False

    def seconds(self) -> float:
        return self.elapsed


class _CudaTimer:
    """Device time between two events (read after the layer's result is back on the host)."""

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        self.begin = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.begin.record(torch.cuda.current_stream(self.device))
        return self

    def __exit__(self, *exc):
        self.end.record(torch.cuda.current_stream(self.device))
        return False

    def seconds(self) -> float:
        self.end.synchronize()
        return self.begin.elapsed_time(self.end) / 1e3


def make_backend(device):
    """The backend of a device name ("cpu", "cuda", "cuda:N", or "auto": CUDA when available),
    or `device` itself when it is already a backend."""
    if hasattr(device, "copy") and hasattr(device, "wait"):
        return device
    device = resolve_device(device)
    if device == "cpu":
        return CpuBackend()
    if device == "cuda" or device.startswith("cuda:"):
        return CudaBackend(device)
    raise ValueError(f"unknown offload device {device!r} (choose cpu, cuda, cuda:N or auto)")


def resolve_device(device: str) -> str:
    """The offload device a name means ("auto": CUDA when available, else the CPU)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def keeps_packed_experts(device: str, dtype) -> bool:
    """Whether the offload engine takes a model's `dtype` experts packed for the CPU: where
    they pack in the native pair layout (the tiers copy its bytes; oneDNN's layout is opaque).
    On the CPU the slots hold that layout too; on CUDA they are plain (`SlotPool`)."""
    from moespec.kernels.cpu import cpu_paths

    on = resolve_device(device).split(":")[0]
    return on in ("cpu", "cuda") and cpu_paths().path(dtype) == "native-pairs"


def expert_tensors(experts: ExpertWeights, e: int) -> tuple[torch.Tensor, ...]:
    """The tensors holding expert (or slot) e's bytes: its gate_up and down rows of the
    stacked tensors, or its two pair-layout weights' packed tensors."""
    if not experts.is_packed:
        return experts.gate_up[e], experts.down[e]
    return experts.packed_gate_up[e].packed, experts.packed_down[e].packed


def copyable_layout(experts: ExpertWeights) -> str | None:
    """Why the offload tiers cannot copy these experts slot by slot (None: they can): plain
    stacked tensors and the native pair layout can; oneDNN's opaque blocked layout and int8
    weights cannot."""
    if not experts.is_packed:
        return None
    if all(isinstance(w, PairWeight) for w in experts.packed_gate_up + experts.packed_down):
        return None
    kind = type(experts.packed_gate_up[0]).__name__
    return (
        f"the experts are held as {kind}, a layout the offload tiers do not copy (plain "
        "tensors and the native bf16 pair layout only): load the model without packing its "
        "experts"
    )


def model_expert_bytes(model) -> tuple[int, int]:
    """(W, w): the bytes of all experts of a Transformer's MoE layers, and of one expert."""
    experts = [block.experts for block in model.moe_blocks.values()]
    if not experts:
        raise ValueError(f"{model.config.name}: the model has no MoE layer to offload")
    total = sum(e.num_experts * e.bytes_per_expert for e in experts)
    return total, experts[0].bytes_per_expert


class ExpertStore:
    """Every expert, in host memory: layers[l] holds MoE layer l's stacked experts."""

    def __init__(self, layers: list[ExpertWeights], backend):
        if not layers:
            raise ValueError("the model has no MoE layer to offload")
        first = layers[0]
        if not all(w.is_plain_swiglu for w in layers):
            raise ValueError(
                "offloading runs plain SwiGLU experts only: these have biases or a clamped "
                "SwiGLU (gpt-oss), which its expert slots do not hold"
            )
        shape = (first.gate_up.shape, first.down.shape, first.dtype, first.is_packed)
        for i, w in enumerate(layers):
            if (why := copyable_layout(w)) is not None:
                raise ValueError(f"MoE layer {i}: {why}")
            if (w.gate_up.shape, w.down.shape, w.dtype, w.is_packed) != shape:
                raise ValueError(
                    f"MoE layer {i} has experts of another shape, dtype or layout than layer "
                    "0: the offload cache shares its slots across layers and needs them alike"
                )
        self.layers = [backend.host(w) for w in layers]
        self.num_layers = len(layers)
        self.num_experts = first.num_experts
        self.bytes_per_expert = first.bytes_per_expert  # w_l, the same for every layer

    @property
    def total_bytes(self) -> int:
        """W: the bytes of all experts."""
        return self.num_layers * self.num_experts * self.bytes_per_expert

    def slot_pool(self, slots: int, backend) -> "SlotPool":
        """The device cache of `slots` experts this store's copies fill."""
        plain = getattr(backend, "plain_slots", False)
        return SlotPool(slots, self.layers[0], backend.device, plain=plain)

    def compute(self, kernel, layer: int, x, expert_ids, expert_weights):
        """The CPU tier: y [T, H] of MoE layer `layer`'s experts computed where they lie."""
        return kernel(x, expert_ids, expert_weights, self.layers[layer])


class SlotPool:
    """S expert slots on the device, allocated once; `weights` is the pool as one ExpertWeights
    (a kernel given slot indices as expert ids computes cached experts where they lie).

    The slots hold experts in the store's layout, or with `plain` (a device's kernels read
    plain tensors) as stacked [S, 2I, H] and [S, H, I] tensors whatever the store holds: a
    pair-layout expert then crosses into a staging buffer of its own layout on the device and
    is laid out plain there (`fill`)."""

    def __init__(self, slots: int, like: ExpertWeights, device: torch.device, plain=False):
        _, two_i, hidden = like.gate_up.shape
        shapes = ((slots, two_i, hidden), (slots, hidden, two_i // 2))  # [S, 2I, H], [S, H, I]
        self.staging = None
        if like.is_packed and plain:
            self.staging = tuple(
                torch.empty_like(w[0].packed, device=device)
                for w in (like.packed_gate_up, like.packed_down)
            )
        if like.is_packed and not plain:  # pair-layout slots, one weight each
            if device.type != "cpu":
                raise ValueError("pair-layout expert slots live in host memory: device cpu")
            self.weights = ExpertWeights(
                *(torch.empty(shape, dtype=like.dtype, device="meta") for shape in shapes),
                packed_gate_up=[like.packed_gate_up[0].empty_like() for _ in range(slots)],
                packed_down=[like.packed_down[0].empty_like() for _ in range(slots)],
            )
        else:
            self.weights = ExpertWeights(
                *(torch.empty(shape, dtype=like.dtype, device=device) for shape in shapes)
            )
        if device.type == "cpu":
            # Touched once here, so that a copy into a slot is a copy, not a first write that
            # faults in every page of fresh memory (the pool's pages stay mapped from then on).
            for slot in range(slots):
                for tensor in expert_tensors(self.weights, slot):
                    tensor.zero_()
        self.slots = slots
        self._free = list(range(slots - 1, -1, -1))  # pop() hands out slot 0 first

    def fill(self, slot: int, source: ExpertWeights, e: int, non_blocking=False) -> None:
        """Copy expert e of `source` (the store) into `slot`: byte for byte where both hold one
        layout, else its pair-layout bytes through the staging buffer, laid out plain."""
        targets = expert_tensors(self.weights, slot)
        if self.staging is None:
            for target, expert in zip(targets, expert_tensors(source, e), strict=True):
                target.copy_(expert, non_blocking=non_blocking)
            return
        for target, stage, weight in zip(targets, self.staging, source.weights(e), strict=True):
            stage.copy_(weight.packed, non_blocking=non_blocking)
            unpack_pairs_into(target, stage)  # after the bytes, on the same stream

    @property
    def used(self) -> int:
        return self.slots - len(self._free)

    def take(self) -> int:
        return self._free.pop()

    def release(self, slot: int) -> None:
        self._free.append(slot)


class Link:
    """The copy engine between the tiers: daemon threads copying one expert at a time each
    (one thread, unless the backend asks for more: the disk tier keeps several reads in flight).

    `fetches` (on-demand copies, appended by the executor) go first; when none is waiting the
    link asks `pull()` for the next prefetch (None: idle until notified). `pull` and `arrived`
    run under `lock` (the executor's, guarding the policy and the cache); copies run outside it.
    """

    def __init__(self, pool: SlotPool, store: ExpertStore, backend, lock, pull, arrived):
        self.pool, self.store, self.backend = pool, store, backend
        self.lock, self.pull, self.arrived = lock, pull, arrived
        self.fetches: deque[CopyJob] = deque()
        self.closed = False
        self.idle = 0  # threads waiting for work
        # busy time: wall seconds with at least one copy in flight (under `lock`)
        self.in_flight, self.busy_since, self.busy_seconds = 0, 0.0, 0.0
        self.error: BaseException | None = None
        self.threads = [
            threading.Thread(target=self._run, name=f"moespec-offload-link-{i}", daemon=True)
            for i in range(getattr(backend, "link_threads", 1))
        ]
        for thread in self.threads:
            thread.start()

    @property
    def waiting(self) -> bool:
        return self.idle > 0

    def _next(self) -> CopyJob | None:
        with self.lock:
            while not self.closed:
                job = self.fetches.popleft() if self.fetches else self.pull()
                if job is not None:
                    if self.in_flight == 0:
                        self.busy_since = time.perf_counter()
                    self.in_flight += 1
                    return job
                self.idle += 1  # idle: the executor wakes it when there is work
                self.lock.wait()
                self.idle -= 1
            return None

    def _run(self) -> None:
        try:
            while (job := self._next()) is not None:
                start = time.perf_counter()
                self.backend.copy(self.pool, job, self.store.layers[job.layer])
                job.seconds = time.perf_counter() - start
                with self.lock:
                    self.in_flight -= 1
                    if self.in_flight == 0:
                        self.busy_seconds += time.perf_counter() - self.busy_since
                    self.arrived(job)
        except BaseException as error:  # surfaced by the executor instead of hanging it
            with self.lock:
                self.error = self.error or error
                self.closed = True
                self.lock.notify_all()

    def take_busy(self) -> float:
        """The link's busy seconds since the last call (under `lock`): what its copies cost
        it. Each read's own duration would count a second four times over with four reads in
        flight, and price a copy at four times what it takes from the link."""
        now = time.perf_counter()
        seconds = self.busy_seconds + (now - self.busy_since if self.in_flight else 0.0)
        self.busy_seconds, self.busy_since = 0.0, now
        return seconds

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.lock.notify_all()
        for thread in self.threads:
            thread.join()
