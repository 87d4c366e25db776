"""The offload policy interface, shared by the simulator and (later) the engine.

An expert lives in the host store; the accelerator holds an `ExpertCache` of some experts under
a byte budget. For every verification pass (one step) and every MoE layer l, once the router has
named the pass's experts E_l with slot counts c_e, the policy returns a `LayerPlan`:

    accelerator   experts computed on the accelerator: resident, arriving, or fetched now
    cpu           experts computed on the CPU, where the host store holds them
    fetch         the absent experts among `accelerator`: copied now, ahead of any prefetch

Between layers and steps the policy feeds a prefetch queue the link pulls from
(`next_prefetch`), and names an eviction victim when a copy needs room (`choose_victim`). The
caller (simulator or engine) owns time and the link, enforces the budget and the pins, and
reports timings back (`observe_layer`, `observe_step`) so a policy can learn its coefficients.

Call order per step: begin_step, then per layer: plan_layer, [choose_victim / admitted while
copies start], end_layer, observe_layer; then end_step(accepted).
"""

from array import array
from dataclasses import dataclass

import numpy as np


class CacheBudgetError(RuntimeError):
    """A policy tried to exceed the cache budget or to evict an expert in use."""


class ExpertCache:
    """Which experts (layer, expert) occupy accelerator memory, under `budget_bytes`.

    An expert occupies its bytes from the moment its copy starts; it is usable from
    `ready_at[l, e]` (inf when absent). Pinned experts (in use by the layer being computed)
    and experts still arriving cannot be evicted.
    """

    def __init__(self, expert_bytes, num_experts: int, budget_bytes: int):
        self.expert_bytes = np.asarray(expert_bytes, dtype=np.int64)  # [L]
        self._sizes = self.expert_bytes.tolist()  # the same, as Python ints (quicker per call)
        self.num_layers = len(self.expert_bytes)
        self.num_experts = num_experts
        self.budget_bytes = int(budget_bytes)
        if self.budget_bytes < 0:
            raise ValueError(f"cache budget must be >= 0 bytes, got {budget_bytes}")
        self.ready_at = np.full((self.num_layers, num_experts), np.inf)  # [L, N]
        self.present = np.zeros((self.num_layers, num_experts), dtype=bool)  # [L, N]
        self.pinned = np.zeros((self.num_layers, num_experts), dtype=bool)  # [L, N]
        self.used_bytes = 0
        self.peak_bytes = 0

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes

    def fits(self, layer: int) -> bool:
        return self._sizes[layer] <= self.budget_bytes - self.used_bytes

    def capacity(self) -> int:
        """Experts the budget holds at the largest expert size (a conservative count)."""
        return int(self.budget_bytes // max(int(self.expert_bytes.max()), 1))

    def insert(self, layer: int, expert: int, ready_at: float = 0.0) -> None:
        if self.present[layer, expert]:
            raise CacheBudgetError(f"expert {expert} of layer {layer} is already cached")
        size = self._sizes[layer]
        if size > self.budget_bytes - self.used_bytes:
            raise CacheBudgetError(
                f"caching expert {expert} of layer {layer} would exceed the budget "
                f"({self.used_bytes} + {size} > {self.budget_bytes} bytes)"
            )
        self.present[layer, expert] = True
        self.ready_at[layer, expert] = ready_at
        self.used_bytes += size
        if self.used_bytes > self.peak_bytes:
            self.peak_bytes = self.used_bytes

    def evictable(self, layer: int, expert: int, now: float) -> bool:
        return (
            bool(self.present[layer, expert])
            and not self.pinned[layer, expert]
            and self.ready_at[layer, expert] <= now
        )

    def evict(self, layer: int, expert: int, now: float) -> None:
        if not self.present[layer, expert]:
            raise CacheBudgetError(f"expert {expert} of layer {layer} is not cached")
        if self.pinned[layer, expert]:
            raise CacheBudgetError(f"expert {expert} of layer {layer} is in use")
        if self.ready_at[layer, expert] > now:
            raise CacheBudgetError(f"expert {expert} of layer {layer} is still arriving")
        self.present[layer, expert] = False
        self.ready_at[layer, expert] = np.inf
        self.used_bytes -= self._sizes[layer]

    def ready(self, layer: int, experts: np.ndarray, now: float) -> np.ndarray:
        """Bool mask over `experts`: resident and arrived by `now`."""
        return self.ready_at[layer, experts] <= now


@dataclass
class LayerPlan:
    accelerator: np.ndarray  # expert ids computed on the accelerator
    cpu: np.ndarray  # expert ids computed on the CPU
    fetch: np.ndarray  # absent experts of `accelerator`, copied on demand (blocking)


@dataclass(slots=True)
class LayerTiming:
    """What the caller measured for one layer of one pass (seconds and counts)."""

    layer: int
    seconds: float  # router output to the end of the layer's experts
    cpu_seconds: float  # CPU busy time on the layer's CPU experts
    cpu_slots: int  # (token, expert) pairs computed on the CPU
    cpu_experts: int
    accelerator_seconds: float  # accelerator busy time on the layer's experts
    accelerator_experts: int
    copy_seconds: float  # link time of copies started during the layer
    copies: int


class UnitTimes:
    """Running means of the unit times a policy plans with, learned from observed timings.

    T^u_cpu per CPU slot and per CPU expert, T^u_gpu per accelerator expert, T^u_io per copy
    (seed 003 eq. 7-10), the draft time per drafted token, each layer's mean time, and what a
    split costs: a layer's time beyond its tiers' busy times, as a mean over passes that ran
    on both tiers less the mean over passes on one (`split_seconds`; the gather, scatter and
    second call of a split layer, measured where the tiers share a processor). Each is None
    until observed.
    """

    _KEYS = (
        "cpu_seconds",
        "cpu_slots",
        "cpu_experts",
        "acc_seconds",
        "acc_experts",
        "copy_seconds",
        "copies",
        "draft_seconds",
        "drafted",
    )

    _INDEX = {key: i for i, key in enumerate(_KEYS)}

    def __init__(self, num_layers: int):
        # The sums in _KEYS order: array('d')s are as quick as a dict from Python, and plain
        # doubles to SpAc's C kernel, which adds to them in place (spac_kernel.make_state).
        self.totals = array("d", [0.0] * len(self._KEYS))
        self.layer_seconds = np.zeros(num_layers)
        self.layer_passes = np.zeros(num_layers)
        self.rest = array("d", [0.0, 0.0])  # beyond the tiers' busy times: [one tier, both]
        self.rest_passes = array("d", [0.0, 0.0])

    @property
    def sums(self) -> dict[str, float]:
        """The sums by name (a copy)."""
        return dict(zip(self._KEYS, self.totals, strict=True))

    def observe_layer(self, t: LayerTiming) -> None:
        split = int(t.cpu_experts > 0 and t.accelerator_experts > 0)
        self.rest[split] += t.seconds - t.cpu_seconds - t.accelerator_seconds
        self.rest_passes[split] += 1
        s = self.totals  # in _KEYS order
        s[0] += t.cpu_seconds
        s[1] += t.cpu_slots
        s[2] += t.cpu_experts
        s[3] += t.accelerator_seconds
        s[4] += t.accelerator_experts
        s[5] += t.copy_seconds
        s[6] += t.copies
        self.layer_seconds[t.layer] += t.seconds
        self.layer_passes[t.layer] += 1

    def observe_draft(self, seconds: float, drafted: int) -> None:
        self.totals[7] += seconds
        self.totals[8] += drafted

    def _ratio(self, numerator: str, denominator: str) -> float | None:
        d = self.totals[self._INDEX[denominator]]
        return self.totals[self._INDEX[numerator]] / d if d > 0 else None

    @property
    def cpu_per_slot(self) -> float | None:
        return self._ratio("cpu_seconds", "cpu_slots")

    @property
    def cpu_per_expert(self) -> float | None:
        return self._ratio("cpu_seconds", "cpu_experts")

    @property
    def accelerator_per_expert(self) -> float | None:
        return self._ratio("acc_seconds", "acc_experts")

    @property
    def copy_per_expert(self) -> float | None:
        return self._ratio("copy_seconds", "copies")

    @property
    def draft_per_token(self) -> float | None:
        return self._ratio("draft_seconds", "drafted")

    @property
    def split_seconds(self) -> float | None:
        """A split layer's time beyond its tiers' and a one-tier layer's, at least 0 (the tiers
        taken to run one after the other: on tiers that overlap, a split can cost nothing)."""
        (one, both), (n_one, n_both) = self.rest, self.rest_passes
        return max(both / n_both - one / n_one, 0.0) if n_one and n_both else None

    def mean_layer_seconds(self, layer: int) -> float | None:
        n = self.layer_passes[layer]
        return self.layer_seconds[layer] / n if n else None


class OffloadPolicy:
    """Base class: hyperparameters in __init__, `fit(trace)` for offline statistics, `reset`
    per run. The default start is the same for every policy: the cache preloaded with the
    experts most frequent in the fit split (when fitted), highest first, until the budget is full.
    """

    name = "policy"
    speculative = True  # False: the simulator runs plain decoding (one token per step)
    # The share of the shorter tier's work hidden under the longer one (set by the driver at
    # start: 1 where the accelerator is a device of its own, 0 where both tiers and the link
    # run on one processor, as the CPU engine's do).
    tier_overlap = 1.0

    def fit(self, trace) -> "OffloadPolicy":
        """Slot counts per (layer, expert) over a fit split of routing: frequencies_ [L, N]."""
        ids = np.asarray(trace.expert_ids)  # [T, L, m]
        layers, experts = ids.shape[1], trace.num_experts
        flat = ids.astype(np.int64) + experts * np.arange(layers)[None, :, None]
        counts = np.bincount(flat.ravel(), minlength=layers * experts)
        self.frequencies_ = counts.reshape(layers, experts)
        return self

    def reset(self, cache: ExpertCache, *, draft_length: int, top_k: int) -> None:
        self.bind(cache, draft_length=draft_length, top_k=top_k)
        if getattr(self, "frequencies_", None) is not None:
            self.preload(self.frequencies_)

    def bind(self, cache: ExpertCache, *, draft_length: int, top_k: int) -> None:
        """The run's cache and shapes, and fresh unit times: `reset` before its preload."""
        self.cache = cache
        self.draft_length = draft_length
        self.top_k = top_k
        self.unit_times = UnitTimes(cache.num_layers)

    def preload(self, frequencies: np.ndarray) -> list[tuple[int, int]]:
        """Fill the cache with the most frequent experts (ties: lower layer, lower id)."""
        cache = self.cache
        order = np.argsort(-frequencies.ravel(), kind="stable")
        loaded = []
        for flat in order:
            if frequencies.flat[flat] <= 0:
                break
            layer, expert = divmod(int(flat), cache.num_experts)
            if cache.fits(layer) and not cache.present[layer, expert]:
                cache.insert(layer, expert, ready_at=-np.inf)
                self.admitted(layer, expert)
                loaded.append((layer, expert))
        return loaded

    # Per step and layer.
    def begin_step(self, n_tokens: int) -> None:
        pass

    def plan_layer(self, layer: int, experts: np.ndarray, counts: np.ndarray, now: float):
        raise NotImplementedError

    def end_layer(self, layer: int, experts: np.ndarray, counts: np.ndarray) -> None:
        pass

    def end_step(self, accepted: int) -> None:
        pass

    # The link and the cache.
    def next_prefetch(self) -> tuple[int, int] | None:
        return None

    def has_prefetch(self) -> bool:
        """Whether next_prefetch may yield work now (the engine wakes its idle link only then)."""
        return False

    def choose_victim(self, layer: int, expert: int, now: float) -> tuple[int, int] | None:
        """An evictable (layer, expert) to make room for `expert` of `layer`, or None."""
        return None

    def admitted(self, layer: int, expert: int) -> None:
        """`expert` of `layer` now occupies the cache (its copy started, or it was preloaded)."""

    # Feedback and introspection.
    def observe_layer(self, timing: LayerTiming) -> None:
        self.unit_times.observe_layer(timing)

    def observe_draft(self, seconds: float, drafted: int) -> None:
        self.unit_times.observe_draft(seconds, drafted)

    def layer_kernel(self):
        """None, or an object that runs a layer's decisions and the driver's bookkeeping in
        two calls, for a policy whose plans fetch nothing (spac_kernel.py):

            plan(layer, experts, counts, now, pin=True) -> (accelerator, cpu, hits)
                plan_layer's split, the accelerator experts pinned, the needed experts
                resident and arrived by `now` counted; distinct ids in 0..N-1 or ValueError
            finish(layer, experts, counts, accelerator, timing, used_bytes)
                unpin `accelerator`, end_layer, observe_layer(timing)

        The driver uses it in place of plan_layer, check_plan, end_layer and observe_layer."""
        return None

    def predicted_hot(self, layer: int) -> np.ndarray | None:
        """Bool [N]: the experts predicted active in this layer's next pass (None: no forecast)."""
        return None

    def stats(self) -> dict:
        return {}


def split_by_mask(experts: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return experts[mask], experts[~mask]


EMPTY = np.zeros(0, dtype=np.int64)
