"""The layer driver: what every offload run does around a policy, whatever keeps its time.

One driver serves the simulator (a virtual clock, copies timed by a cost model) and the engine
(the wall clock, copies made by a thread). Per pass and MoE layer l, once the router has named
the pass's experts E_l with slot counts c_e (seed 003 §2.3):

    plan      policy.plan_layer(l, E_l, c, now), checked: every needed expert computed once,
              fetches absent, the other accelerator experts cached
    pin       the cached accelerator experts, before any fetch looks for room
    fetch     each expert of `fetch` is admitted (room made from the policy's victims) and
              handed to the back end's link; one that finds no room runs on the CPU instead
    finish    unpin, policy.end_layer, policy.observe_layer(what the back end measured)

`admit` is the one way into the cache (fetches, prefetches): victims are evicted only when the
cache's rules allow it (not pinned, arrived), and `OffloadStats` counts everything once, with
one set of names for both back ends. The back end is any object with three methods:

    arrival(layer, now) -> float      when a copy started at `now` is usable (inf: not known yet)
    copy_started(layer, expert, kind) the expert holds its bytes now; start moving them
    evicted(layer, expert)            the expert's bytes are free again

A policy with a `layer_kernel` (SpAc's C kernel, whose plans fetch nothing) does plan, check
and pin in one call and finish in another: the same decisions, without Python per expert.

The budget: `expert_cache_budget` (one rule for both back ends) is floor(ratio x W) bytes of
all expert bytes W, or a byte count.
"""

from dataclasses import dataclass, fields

import numpy as np

from moespec.offload.policies.base import EMPTY, CacheBudgetError, ExpertCache, LayerTiming


class PlanError(RuntimeError):
    """A policy's layer plan does not compute every needed expert exactly once."""


@dataclass(slots=True)
class OffloadStats:
    """Counts of an offload run (or of one step of it), the same for the simulator and engine."""

    hits: int = 0  # needed experts resident and arrived when their layer was planned
    misses: int = 0
    bytes_copied: int = 0  # bytes of the copies started (fetches and prefetches)
    cpu_experts: int = 0  # experts computed on the CPU (planned there, or fetches with no room)
    copies: int = 0
    fetches: int = 0  # on-demand copies that found room
    prefetches: int = 0
    fallbacks: int = 0  # fetches that found no room and ran on the CPU
    copy_wait_seconds: float = 0.0  # accelerator time spent waiting for arriving experts

    @property
    def needed(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        return self.hits / self.needed if self.needed else 0.0

    def add(self, other: "OffloadStats") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def minus(self, other: "OffloadStats") -> "OffloadStats":
        names = [f.name for f in fields(self)]
        return OffloadStats(**{n: getattr(self, n) - getattr(other, n) for n in names})

    def copy(self) -> "OffloadStats":
        return OffloadStats(**self.to_dict())

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(slots=True)
class Placement:
    """Where one layer's experts run once the plan's fetches are settled."""

    accelerator: np.ndarray  # expert ids computed on the accelerator (pinned)
    cpu: np.ndarray  # expert ids computed on the CPU
    fetch: np.ndarray  # the plan's on-demand copies (those that found no room are in `cpu`)


def expert_cache_budget(
    total_bytes: int,
    bytes_per_expert: int,
    *,
    ratio: float | None = None,
    nbytes=None,
    least_experts: int = 1,
) -> int:
    """The expert cache budget in bytes: floor(`ratio` x W) of all expert bytes W, or `nbytes`.

    A budget below `least_experts` experts is an error (the engine needs one slot; a simulation
    may pass 0 to study a cache that holds nothing). A budget of W or more needs no offloading.
    """
    if (ratio is None) == (nbytes is None):
        raise ValueError("give the expert cache as a ratio or as bytes, not both or neither")
    if ratio is not None:
        if ratio < 0 or (least_experts and not ratio > 0):
            raise ValueError(f"expert cache ratio must be > 0, got {ratio}")
        budget, what = int(ratio * total_bytes), f"expert cache ratio {ratio:g}"
    else:
        if int(nbytes) < 0:
            raise ValueError(f"expert cache bytes must be >= 0, got {nbytes}")
        budget, what = int(nbytes), "expert cache"
    if budget < least_experts * bytes_per_expert:
        raise ValueError(
            f"{what} of {budget} bytes holds no expert: one expert is {bytes_per_expert} bytes "
            f"(the least budget; ratio {bytes_per_expert / total_bytes:.3g} of all expert bytes)"
        )
    return budget


def fits_in_memory(budget_bytes: int, total_bytes: int) -> bool:
    """A budget that holds every expert: nothing to offload."""
    return budget_bytes >= total_bytes


class LayerDriver:
    """Runs a policy against an `ExpertCache` for a back end (see the module docstring).

    The caller serialises the calls (the engine holds its lock around each); `log`, when a list,
    receives ("pin" | "evict" | "unpin", layer, experts) in call order (for tests).
    """

    def __init__(self, cache: ExpertCache, policy, backend, log: list | None = None):
        self.cache, self.policy, self.backend, self.log = cache, policy, backend, log
        self.stats = OffloadStats()
        self.preload_bytes = 0
        self.kernel = None  # the policy's layer_kernel, once started

    def start(self, *, draft_length: int, top_k: int, tier_overlap: float = 1.0) -> None:
        """Reset the policy on the cache, telling it how far the tiers' work overlaps
        (`OffloadPolicy.tier_overlap`); what it preloads counts as `preload_bytes`."""
        self.policy.tier_overlap = float(tier_overlap)
        self.policy.reset(self.cache, draft_length=draft_length, top_k=top_k)
        self.preload_bytes = self.cache.used_bytes
        self.kernel = self.policy.layer_kernel()

    # One layer of a pass.
    def plan(self, layer: int, experts: np.ndarray, counts: np.ndarray, now: float, fetch):
        """Plan, check, pin and fetch; `fetch(layer, expert, now)` -> False when no room."""
        kernel = self.kernel
        if kernel is not None:  # plan, check (distinct ids in range) and pins in one call
            accelerator, cpu, hits = kernel.plan(layer, experts, counts, now, True)
            stats = self.stats
            stats.hits += hits
            stats.misses += len(experts) - hits
            stats.cpu_experts += len(cpu)
            if self.log is not None:
                self._log("pin", layer, np.sort(accelerator))
            return Placement(accelerator, cpu, EMPTY)
        cache, stats, log = self.cache, self.stats, self.log
        hits = int(np.count_nonzero(cache.ready_at[layer][experts] <= now))  # cache.ready
        plan = self.policy.plan_layer(layer, experts, counts, now)
        stay = check_plan(plan, experts, cache.present[layer], layer)
        pinned = cache.pinned[layer]  # a view of the layer's row
        pinned[stay] = True
        if log is not None:
            self._log("pin", layer, stay)
        failed = []
        for e in plan.fetch.tolist():
            pinned[e] = True
            if fetch(layer, e, now):
                if log is not None:
                    self._log("pin", layer, [e])
            else:  # every cached expert is in use or arriving: run it on the CPU
                pinned[e] = False
                failed.append(e)
        accelerator, cpu = plan.accelerator, plan.cpu
        if failed:
            accelerator = np.setdiff1d(accelerator, failed)
            cpu = np.concatenate([cpu, failed]).astype(np.int64)
        stats.hits += hits
        stats.misses += len(experts) - hits
        stats.fetches += len(plan.fetch) - len(failed)
        stats.fallbacks += len(failed)
        stats.cpu_experts += len(cpu)
        return Placement(accelerator, cpu, plan.fetch)

    def finish(self, layer, experts, counts, placement: Placement, timing: LayerTiming) -> None:
        kernel = self.kernel
        if kernel is not None:  # unpin, end_layer, observe_layer in one call
            kernel.finish(
                layer, experts, counts, placement.accelerator, timing, self.cache.used_bytes
            )
            if self.log is not None:
                self._log("unpin", layer, placement.accelerator)
            return
        self.cache.pinned[layer][placement.accelerator] = False
        if self.log is not None:
            self._log("unpin", layer, placement.accelerator)
        policy = self.policy
        policy.end_layer(layer, experts, counts)
        policy.observe_layer(timing)

    # The cache's one door.
    def admit(self, layer: int, expert: int, kind: str, now: float) -> bool:
        """Make room (the policy's victims), insert (layer, expert) as copied from `now`."""
        cache, policy, backend = self.cache, self.policy, self.backend
        while not cache.fits(layer):
            victim = policy.choose_victim(layer, expert, now)
            if victim is None:
                return False
            vl, ve = int(victim[0]), int(victim[1])
            cache.evict(vl, ve, now=now)
            backend.evicted(vl, ve)
            if self.log is not None:
                self._log("evict", vl, [ve])
        cache.insert(layer, expert, ready_at=backend.arrival(layer, now))
        policy.admitted(layer, expert)
        stats = self.stats
        stats.copies += 1
        stats.prefetches += kind == "prefetch"
        stats.bytes_copied += cache._sizes[layer]
        backend.copy_started(layer, expert, kind)
        return True

    def pull(self, now: float) -> tuple[int, int] | None:
        """The link is idle at `now`: admit the policy's next prefetch that finds room."""
        while (item := self.policy.next_prefetch()) is not None:
            layer, expert = int(item[0]), int(item[1])
            if not self.cache.present[layer, expert] and self.admit(layer, expert, "prefetch", now):
                return layer, expert
        return None

    def check_budget(self) -> None:
        if self.cache.peak_bytes > self.cache.budget_bytes:  # insert() forbids it; belt and braces
            raise CacheBudgetError("the cache exceeded its budget")

    def _log(self, event: str, layer: int, experts) -> None:
        if self.log is not None:
            self.log.append((event, layer, tuple(int(e) for e in experts)))


def check_plan(plan, experts: np.ndarray, present: np.ndarray, layer: int) -> np.ndarray:
    """Every needed expert computed exactly once; fetches absent and on the accelerator, the
    rest of `accelerator` resident (seed 003's contract). Returns that rest, in increasing id.

    `experts` are the layer's needed expert ids (distinct), `present` its residency [N]. The
    checks are masks over the layer's N experts: a few array operations per layer, whatever
    the plan's size (this runs on every layer of every pass)."""
    n = len(present)
    accelerator, cpu, fetch = plan.accelerator, plan.cpu, plan.fetch
    planned = np.concatenate([accelerator, cpu])
    try:
        times = np.bincount(planned, minlength=n)  # how often the plan computes each expert
    except (ValueError, TypeError):  # a negative or non-integer id
        times = None
    if times is None or len(times) != n:
        raise PlanError(f"layer {layer}: the plan names an expert outside 0..{n - 1}")
    if len(planned) != len(experts) or not times[experts].all() or times.max(initial=0) > 1:
        raise PlanError(f"layer {layer}: the plan does not compute every needed expert once")
    if not len(fetch):
        stay = np.sort(accelerator)
    else:
        on_accelerator = np.zeros(n, dtype=bool)
        on_accelerator[accelerator] = True
        fetched = np.zeros(n, dtype=bool)
        fetched[fetch] = True
        if present[fetch].any() or not on_accelerator[fetch].all():
            raise PlanError(
                f"layer {layer}: fetches must be absent, other accelerator experts cached"
            )
        stay = np.flatnonzero(on_accelerator & ~fetched)
    if not present[stay].all():
        raise PlanError(f"layer {layer}: fetches must be absent, other accelerator experts cached")
    return stay
