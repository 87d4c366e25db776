"""Offloaded execution of MoE layers: the policy decides, the tiers compute, the link copies.

    engine = OffloadEngine.for_model(model, make_policy("spac"), budget_bytes, draft_length=4)
    records = list(generate(model, prompt, max_tokens=64, drafter=..., offload=engine))
    engine.close()

The caller brackets every pass: begin_step(n_tokens) ... end_step(accepted). For each MoE layer
l of the pass, once the router has named its experts E_l with slot counts c_e (seed 003 §2.3):

    plan      policy.plan_layer(l, E_l, c, now) -> accelerator, cpu, fetch (see policy.py)
    fetch     each expert of `fetch` gets a slot (the policy's victims evicted first) and joins
              the link ahead of any prefetch; one with no room left runs on the CPU instead
    compute   in parallel: the CPU experts on a worker thread, from the host store (inline when
              the device is the CPU itself: one processor, a thread adds only its hand-off); the
              accelerator experts from their slots, each waiting for its copy if still arriving
              (on arrival, the disk tier's way: the cached experts' pairs first, then the CPU
              tier's, then each arriving expert's once its copy is in: the copies overlap the
              compute, and the loop waits only for what has not arrived when it is needed)
    combine   y = accelerator part + CPU part
    feedback  policy.end_layer, then policy.observe_layer(the measured LayerTiming)

The link pulls the policy's prefetches whenever it is idle: while layers compute, between
layers and during the next step's draft — the overlap the simulator's timing model assumes.
`now` is seconds since the engine was built; an expert counts as arrived (a hit) once its copy
has finished. The cache's pins, budget and eviction rules are `ExpertCache`'s, as simulated.

Before the first decode step the engine has not started: passes (the prompt) run on the host
tier, and their routing is the fit split of a policy nothing else fitted (`start(fit_trace)`
fits on a trace instead). Starting resets the policy on an empty cache and copies its preload.

Exactness: a pass whose experts all lie on one tier runs the kernel as in memory (the same
kernel and weights, slot indices as expert ids), so on the CPU the result is bit-for-bit the
in-memory one. A pass split across tiers runs each tier's (token, slot) pairs as rows of one
expert each, then adds each token's m weighted outputs: equal up to the rounding of that sum.
"""

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from moespec.kernels import get_kernel
from moespec.kernels import threads as kernel_threads
from moespec.kernels.linear import linear
from moespec.offload.driver import (
    LayerDriver,
    OffloadStats,
    Placement,
    expert_cache_budget,
    fits_in_memory,
)
from moespec.offload.engine.tiers import (
    CopyJob,
    ExpertStore,
    Link,
    make_backend,
    model_expert_bytes,
)
from moespec.offload.policies.base import ExpertCache, LayerTiming

__all__ = [
    "OffloadEngine",
    "OffloadStats",
    "expert_cache_budget",
    "fits_in_memory",
    "model_expert_bytes",
]

# What a StepRecord carries of a step (the engine's own totals carry more).
STEP_FIELDS = ("hits", "misses", "bytes_copied", "cpu_experts")


@dataclass
class _Work:
    """One layer's placement as the compute needs it."""

    placement: Placement
    waits: list  # CopyJobs of accelerator experts still arriving
    slots: np.ndarray  # [N] slot of each expert of the layer (valid for the pinned ones)
    start: float

    @property
    def accelerator(self) -> np.ndarray:
        return self.placement.accelerator

    @property
    def cpu(self) -> np.ndarray:
        return self.placement.cpu


class OffloadEngine:
    """Runs MoE layers with experts in a host store and a device cache of `budget_bytes`.

    experts: {decoder layer index: ExpertWeights} of the MoE layers (the store);
    draft_length: k the policy plans for (0 without speculation); top_k: m;
    device: "cpu", "cuda[:N]" (or a backend of moespec.offload.engine.tiers); cpu_workers: threads
    computing the CPU experts; record: keep a log of pins and evictions (for tests);
    store: a store of the experts' own (the disk tier, moespec.offload.engine.disk) in place of
    the model's tensors in host memory: it brings its backend, its slots and its CPU tier;
    on_arrival: compute a layer whose copies are still arriving in groups, each as it is ready
    (None: as the backend prefers, `compute_on_arrival`; a CPU device only).
    """

    def __init__(
        self,
        experts: dict,
        policy,
        budget_bytes: int,
        *,
        top_k: int,
        draft_length: int = 0,
        device: str = "cpu",
        cpu_workers: int = 1,
        record: bool = False,
        store=None,
        on_arrival: bool | None = None,
    ):
        if cpu_workers < 1:
            raise ValueError(f"cpu_workers must be >= 1, got {cpu_workers}")
        self.layer_indices = sorted(experts)
        self.ordinal = {layer: i for i, layer in enumerate(self.layer_indices)}
        if store is None:
            self.backend = make_backend(device)
            self.store = ExpertStore([experts[i] for i in self.layer_indices], self.backend)
        else:
            self.backend, self.store = store.backend, store
        if on_arrival is None:
            on_arrival = getattr(self.backend, "compute_on_arrival", False)
        if on_arrival and self.backend.device.type != "cpu":
            raise ValueError("computing experts on arrival runs on a CPU device only")
        self.on_arrival = on_arrival
        w, layers, n = self.store.bytes_per_expert, self.store.num_layers, self.store.num_experts
        expert_cache_budget(self.store.total_bytes, w, nbytes=budget_bytes)  # one expert at least
        self.budget_bytes = int(budget_bytes)
        self.pool = self.store.slot_pool(min(self.budget_bytes // w, layers * n), self.backend)
        self.cache = ExpertCache([w] * layers, n, self.budget_bytes)
        self.slot_of = np.full((layers, n), -1, dtype=np.int64)  # [L, N]
        self.policy, self.top_k, self.draft_length = policy, top_k, draft_length
        self.lock = threading.Condition()  # guards the policy, the cache, the slots, the stats
        self.cpu_pool = ThreadPoolExecutor(cpu_workers, thread_name_prefix="moespec-offload-cpu")
        self.link: Link | None = None
        self.started = self._step_open = False
        self._prompt_ids = [[] for _ in range(layers)]
        self._pending: dict[tuple[int, int], CopyJob] = {}
        self._copies_done = 0
        self.log = [] if record else None  # pins, evictions, unpins, in lock order (for tests)
        self.driver = LayerDriver(self.cache, policy, self, self.log)
        self.totals = OffloadStats()  # the driver's counts at the last take_stats()
        self._job: CopyJob | None = None  # the copy the driver admitted last
        self._t0 = time.perf_counter()

    @classmethod
    def for_model(cls, model, policy, budget_bytes: int, **options) -> "OffloadEngine":
        """An engine over a Transformer's MoE blocks (the model's experts are the store)."""
        blocks = model.moe_blocks
        if not blocks:
            raise ValueError(f"{model.config.name}: no MoE layer to offload")
        top_k = next(iter(blocks.values())).top_k
        return cls(
            {i: b.experts for i, b in blocks.items()}, policy, budget_bytes, top_k=top_k, **options
        )

    # Lifecycle.
    def start(self, fit_trace=None) -> None:
        """Fit the policy (on `fit_trace`, else on the passes run so far if it is unfitted),
        reset it on the empty cache, copy its preload, and start the link."""
        if self.started:
            raise RuntimeError("the offload engine has already started")
        trace = fit_trace if fit_trace is not None else self._prompt_trace()
        unfitted = getattr(self.policy, "frequencies_", None) is None
        if trace is not None and (fit_trace is not None or unfitted):
            if (trace.num_layers, trace.num_experts) != self.cache.present.shape:
                raise ValueError(
                    f"the fit trace has {trace.num_layers} MoE layers of {trace.num_experts} "
                    f"experts; the model has {self.cache.num_layers} of {self.cache.num_experts}"
                )
            self.policy.fit(trace)
        with self.lock:
            # On the CPU both tiers are this processor, one after the other (the CPU tier
            # inline), and the link thread shares its cores: no overlap.
            overlap = 0.0 if self.backend.device.type == "cpu" else 1.0
            self.driver.start(
                draft_length=self.draft_length, top_k=self.top_k, tier_overlap=overlap
            )
            for layer, expert in np.argwhere(self.cache.present):
                slot = self.slot_of[layer, expert] = self.pool.take()
                job = CopyJob(int(layer), int(expert), slot, "preload")
                self.backend.copy(self.pool, job, self.store.layers[layer])
        self.link = Link(self.pool, self.store, self.backend, self.lock, self._pull, self._arrived)
        if self.backend.device.type != "cpu":  # the CPU tier runs on a worker thread there:
            # its first torch call sets up its thread pool; pay that before decoding.
            self.cpu_pool.submit(_warm_up, self.store.layers[0]).result()
        self.started = True

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
        self.cpu_pool.shutdown()
        if hasattr(self.store, "close"):
            self.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def begin_step(
        self, n_tokens: int, *, prefill: bool = False, drafted: int = 0, draft_seconds: float = 0.0
    ) -> None:
        """A pass of n tokens follows (a verification pass of k + 1, or a prompt chunk)."""
        if self._step_open:
            raise RuntimeError("end_step() the previous step before beginning another")
        if not self.started and not prefill:
            self.start()
        self._check_link()
        self._step_open = True
        if self.started:
            with self.lock:
                if drafted:
                    self.policy.observe_draft(draft_seconds, drafted)
                self.policy.begin_step(n_tokens)
                self._wake_link()

    def end_step(self, accepted: int) -> None:
        if not self._step_open:
            raise RuntimeError("end_step() without begin_step()")
        self._step_open = False
        if self.started:
            with self.lock:
                self.policy.end_step(accepted)

    def take_stats(self) -> dict:
        """The StepRecord fields (hits, misses, bytes_copied, cpu_experts) since the last take."""
        with self.lock:
            now = self.driver.stats.copy()
            step, self.totals = now.minus(self.totals), now
        return {name: getattr(step, name) for name in STEP_FIELDS}

    def summary(self) -> dict:
        """Totals of the run so far (taken steps), with the cache's budget and use."""
        totals = self.totals.to_dict()
        needed = totals["hits"] + totals["misses"]
        tier = self.store.stats() if hasattr(self.store, "stats") else {}
        if tier:  # the decode loop waited on fetches and on reads for the CPU tier
            tier["stall_seconds"] = totals["copy_wait_seconds"] + tier.pop("read_through_seconds")
        return {
            "policy": getattr(self.policy, "name", type(self.policy).__name__),
            "device": self.backend.name,
            "budget_bytes": self.budget_bytes,
            "slots": self.pool.slots,
            "expert_bytes": self.store.bytes_per_expert,
            "total_expert_bytes": self.store.total_bytes,
            "preload_bytes": self.driver.preload_bytes,
            "peak_cache_bytes": self.cache.peak_bytes,
            "hit_rate": totals["hits"] / needed if needed else None,
            **totals,
            **tier,
            **self.policy.stats(),
        }

    # One MoE layer of a pass (what MoEBlock calls instead of its kernel).
    def __call__(self, layer: int, x, expert_ids, expert_weights, kernel: str):
        """y [T, H] for x [T, H] routed to expert_ids / expert_weights [T, m] in `layer`."""
        if not self._step_open:
            raise RuntimeError("begin_step() before running a pass through the offload engine")
        l = self.ordinal[layer]
        ids = expert_ids.cpu().numpy()  # [T, m]
        if not self.started:
            return self._host_pass(l, x, ids, expert_ids, expert_weights, kernel)
        row = np.bincount(ids.ravel(), minlength=self.store.num_experts)  # slot counts [N]
        experts = np.flatnonzero(row)
        work = self._plan(l, experts, row[experts])
        try:
            y, timing = self._compute(
                l, x, ids, expert_ids, expert_weights, get_kernel(kernel), work
            )
        except BaseException:
            with self.lock:  # nothing computes these experts any more
                self.cache.pinned[l, work.accelerator] = False
            raise
        self._finish(l, experts, row[experts], work, timing)
        return y

    def _host_pass(self, l, x, ids, expert_ids, expert_weights, kernel):
        """Before start: the whole layer on the host tier; its routing kept for the fit."""
        self._prompt_ids[l].append(ids)
        distinct = len(np.unique(ids))
        with self.lock:
            self.driver.stats.misses += distinct
            self.driver.stats.cpu_experts += distinct
        host = torch.device("cpu")
        y = self.store.compute(
            get_kernel(kernel), l, x.to(host), expert_ids.to(host), expert_weights.to(host)
        )
        return y.to(x.device)

    def _prompt_trace(self):
        if not self._prompt_ids[0]:
            return None
        from moespec.routing import RoutingTrace

        ids = np.stack([np.concatenate(p) for p in self._prompt_ids], axis=1)  # [T, L, m]
        self._prompt_ids = [[] for _ in self._prompt_ids]
        return RoutingTrace(
            ids,
            [0, len(ids)],
            ["prompt"],
            self.store.num_experts,
            [self.store.bytes_per_expert] * self.store.num_layers,
            list(self.layer_indices),
        )

    # Under the lock: planning, admitting copies, the link's callbacks.
    def _clock(self) -> float:
        return time.perf_counter() - self._t0

    def _plan(self, l: int, experts: np.ndarray, counts: np.ndarray) -> _Work:
        with self.lock:
            now = self._clock()
            placed = self.driver.plan(l, experts, counts, now, self._fetch)
            pending = self._pending
            waits = [pending[l, e] for e in placed.accelerator.tolist() if (l, e) in pending]
            self._wake_link()
            return _Work(placed, waits, self.slot_of[l].copy(), now)

    def _fetch(self, l: int, e: int, now: float) -> bool:
        """An on-demand copy: admitted, then on the link ahead of any prefetch."""
        if not self.driver.admit(l, e, "fetch", now):
            return False
        self.link.fetches.append(self._job)
        return True

    # The driver's back-end hooks (under the lock).
    def arrival(self, layer: int, now: float) -> float:
        return np.inf  # usable once `_arrived` records its arrival

    def copy_started(self, layer: int, expert: int, kind: str) -> None:
        slot = self.slot_of[layer, expert] = self.pool.take()
        self._job = self._pending[layer, expert] = CopyJob(layer, expert, slot, kind)

    def evicted(self, layer: int, expert: int) -> None:
        self.pool.release(int(self.slot_of[layer, expert]))
        self.slot_of[layer, expert] = -1

    def _pull(self) -> CopyJob | None:
        """The link is idle: the policy's next prefetch that finds room, or None."""
        return None if self.driver.pull(self._clock()) is None else self._job

    def _arrived(self, job: CopyJob) -> None:
        self.cache.ready_at[job.layer, job.expert] = self._clock()
        del self._pending[job.layer, job.expert]
        self._copies_done += 1

    # Outside the lock: the compute.
    def _compute(self, l, x, ids, expert_ids, expert_weights, kernel, work: _Work):
        """(y [T, H], timing pieces): the accelerator experts here, the CPU ones on a worker."""
        if self.on_arrival and work.waits:
            return self._compute_on_arrival(l, x, ids, expert_weights, kernel, work)
        if len(work.cpu) == 0:  # all on the accelerator: the in-memory kernel on slot ids
            slot_ids = torch.from_numpy(work.slots[ids])  # [T, m]
            y, acc_timer, waited = self._accelerator(x, slot_ids, expert_weights, kernel, work)
            return y.to(x.device), (0.0, 0, acc_timer, waited)
        if len(work.accelerator) == 0:  # all on the CPU: the in-memory kernel on the store
            start = time.perf_counter()
            host = (x.cpu(), expert_ids.cpu(), expert_weights.cpu())  # no-ops on the CPU
            y, end = self._cpu(self.store, kernel, l, *host)
            return y.to(x.device), (end - start, ids.size, None, 0.0)
        # Split: each tier computes its (token, slot) pairs as rows of one expert each.
        num_tokens, top_k = ids.shape
        flat = ids.reshape(-1)  # [T m], pair p = (token p // m, slot p % m)
        on_acc = np.isin(flat, work.accelerator)
        acc_pairs, cpu_pairs = np.flatnonzero(on_acc), np.flatnonzero(~on_acc)
        pair_weights = expert_weights.reshape(-1, 1)  # [T m, 1]
        cpu_rows = torch.from_numpy(cpu_pairs // top_k)
        cpu_args = (
            self.store,
            kernel,
            l,
            x.cpu()[cpu_rows],
            torch.from_numpy(flat[cpu_pairs, None]),
            pair_weights.cpu()[torch.from_numpy(cpu_pairs)],
        )
        # The CPU tier's time runs from the hand-off to its result: what the layer waits for.
        cpu_start = time.perf_counter()
        inline = self.backend.device.type == "cpu"  # one processor: a thread only adds a hand-off
        cpu_job = None if inline else self.cpu_pool.submit(self._cpu, *cpu_args)
        acc_rows = torch.from_numpy(acc_pairs // top_k)
        slot_ids = torch.from_numpy(work.slots[flat[acc_pairs]][:, None])  # [P, 1]
        if inline:
            cpu_out, cpu_end = self._cpu(*cpu_args)
        acc_out, acc_timer, waited = self._accelerator(
            x[acc_rows], slot_ids, pair_weights[torch.from_numpy(acc_pairs)], kernel, work
        )
        if not inline:
            cpu_out, cpu_end = cpu_job.result()
        cpu_seconds = cpu_end - cpu_start
        out = x.new_empty(num_tokens * top_k, x.shape[1])  # [T m, H]
        out[torch.from_numpy(acc_pairs)] = acc_out.to(x.device)
        out[torch.from_numpy(cpu_pairs)] = cpu_out.to(x.device)
        y = out.view(num_tokens, top_k, -1).sum(dim=1)  # [T, H]
        return y, (cpu_seconds, len(cpu_pairs), acc_timer, waited)

    def _accelerator(self, x, slot_ids, weights, kernel, work: _Work):
        start = time.perf_counter()
        for job in work.waits:
            self._await(job)
        waited = time.perf_counter() - start if work.waits else 0.0  # stalls on misses only
        device = self.backend.device
        with self.backend.timer() as timer:
            y = kernel(x.to(device), slot_ids.to(device), weights.to(device), self.pool.weights)
        self.backend.used(work.slots[work.accelerator])
        return y, timer, waited

    def _compute_on_arrival(self, l, x, ids, expert_weights, kernel, work: _Work):
        """(y [T, H], timing pieces) of a layer whose copies are arriving, on the CPU: the
        cached experts' (token, slot) pairs first, then the CPU tier's, then the arriving
        experts': once the first queued is in, those in by then, in one call (a call more
        costs a thread fork, milliseconds on a busy 2-core host); each group as rows of one
        expert each, then each token's m weighted outputs added, as a split pass does."""
        num_tokens, top_k = ids.shape
        flat = ids.reshape(-1)  # [T m], pair p = (token p // m, slot p % m)
        pair_weights = expert_weights.reshape(-1, 1)  # [T m, 1]
        out = x.new_empty(num_tokens * top_k, x.shape[1])  # [T m, H]
        on_cpu = np.isin(flat, work.cpu)
        later = np.isin(flat, [job.expert for job in work.waits])  # pairs of arriving experts
        timer = _SummedTimer()

        def in_slots(pairs: np.ndarray, reading: bool) -> None:
            if len(pairs) == 0:
                return
            index = torch.from_numpy(pairs)
            slot_ids = torch.from_numpy(work.slots[flat[pairs]][:, None])  # [P, 1]
            with self.backend.timer() as each, _one_thread(reading):
                rows = x[index // top_k]
                out[index] = kernel(rows, slot_ids, pair_weights[index], self.pool.weights)
            timer.add(each)

        in_slots(np.flatnonzero(~on_cpu & ~later), reading=True)
        cpu_seconds, cpu_pairs = 0.0, np.flatnonzero(on_cpu)
        if len(cpu_pairs):
            start, index = time.perf_counter(), torch.from_numpy(cpu_pairs)
            pair_ids = torch.from_numpy(flat[cpu_pairs, None])
            args = (x[index // top_k], pair_ids, pair_weights[index])
            out[index], end = self._cpu(self.store, kernel, l, *args)
            cpu_seconds = end - start
        waited, arriving = 0.0, list(work.waits)
        while arriving:  # the first queued, with every other one in by then: one kernel call
            start = time.perf_counter()
            self._await(arriving[0])
            waited += time.perf_counter() - start
            arrived = [job for job in arriving if job.wait_issued(0)]
            arriving = [job for job in arriving if job not in arrived]
            in_slots(np.flatnonzero(np.isin(flat, [job.expert for job in arrived])), bool(arriving))
        y = out.view(num_tokens, top_k, -1).sum(dim=1)  # [T, H]
        return y, (cpu_seconds, len(cpu_pairs), timer, waited)

    @staticmethod
    def _cpu(store, kernel, l, x, expert_ids, expert_weights):
        """(y, the time it was ready) of the CPU tier's experts."""
        with torch.inference_mode():  # a worker thread: the caller's mode is thread-local
            y = store.compute(kernel, l, x, expert_ids, expert_weights)
            return y, time.perf_counter()

    def _await(self, job: CopyJob) -> None:
        while not job.wait_issued(0.5):
            self._check_link()
        self.backend.wait(job)

    def _check_link(self) -> None:
        if self.link is not None and self.link.error is not None:
            error = self.link.error
            if isinstance(error, OSError | ValueError):  # a one-line fault (a disk read's)
                raise error
            raise RuntimeError("the offload link failed") from error

    def _finish(self, l, experts, counts, work: _Work, timing) -> None:
        cpu_seconds, cpu_slots, acc_timer, waited = timing
        acc_seconds = acc_timer.seconds() if acc_timer is not None else 0.0
        end = self._clock()
        with self.lock:
            # the link's busy time (not the reads' own, which overlap): the simulator's reading
            copy_seconds = self.link.take_busy() if self.link is not None else 0.0
            copies, self._copies_done = self._copies_done, 0
            measured = LayerTiming(
                l,
                end - work.start,
                cpu_seconds,
                cpu_slots,
                len(work.cpu),
                acc_seconds,
                len(work.accelerator),
                copy_seconds,
                copies,
            )
            self.driver.finish(l, experts, counts, work.placement, measured)
            self.driver.stats.copy_wait_seconds += waited
            self._wake_link()

    def _wake_link(self) -> None:
        """Wake the link only when it is idle and has work: a waiting fetch or a prefetch.
        Each needless wake-up is a thread switch (0.4-2 ms on a loaded 2-core host, measured:
        most of the static policy's overhead there, and half of SpAc's)."""
        link = self.link
        if link is not None and link.waiting and (link.fetches or self.policy.has_prefetch()):
            self.lock.notify_all()


@contextlib.contextmanager
def _one_thread(reading: bool):
    """The kernel's products on one thread while reads are in flight: the link's threads wake
    on the other core, and a product forked over two threads then waits for the scheduler at
    its barrier (`moespec.kernels.threads`: 3-10x slower; an expert call measured 4x on a
    loaded 2-core host). The pass's setting is the kernels' thread-local one."""
    if not reading:
        yield
        return
    state = kernel_threads._state
    available = getattr(state, "available", None)
    state.available = 1
    try:
        yield
    finally:
        state.available = available


class _SummedTimer:
    """The kernel time of a layer computed in several calls."""

    def __init__(self):
        self.total = 0.0

    def add(self, timer) -> None:
        self.total += timer.seconds()

    def seconds(self) -> float:
        return self.total


def _warm_up(experts) -> None:
    with torch.inference_mode():
        down = experts.weights(0)[1]
        linear(torch.zeros(2, experts.intermediate_size, dtype=experts.dtype), down)
