"""MoE-SpAc as an offload policy (seed 003 §3): estimator -> balancer -> prefetch / evict.

Per layer l of a pass:
  plan_layer  the router has named the pass's experts: cached (or arriving) ones run on the
              accelerator, the rest on the CPU (a miss is never fetched on demand: "CPU fallback
              handles prediction errors", App. B.2); this layer's prefetches that have not
              started are cancelled (they would arrive after they are needed). Where the
              balancer chose tau = K + 1 (tiers on one processor only), every expert runs on
              the CPU, cached or not: the layer in one call, as the balancer's T_cpu assumed.
  end_layer   the estimator observes the layer's frequencies (the pass, or the last 10 tokens
              without speculation) and updates u; the balancer picks tau_l for the next pass;
              experts with u >= tau_l not cached join the prefetch queue at level u, so the
              link works on the next pass's experts during the rest of this pass and the draft.
  victims     lowest utility first, LRU within a utility, and only below the incoming
              expert's utility (a prefetch never displaces an expert at least as hot).

Ablations (seed 003 Table 2) are `SpAcConfig` switches; see `ABLATIONS`. Beyond the paper:
where the driver says the tiers share one processor (`tier_overlap` below 1: the CPU engine),
the balancer weighs the layer's whole time, copies and the cost of a split included, and may
prefetch nothing and run the layer on the CPU alone (balancer.py), from the first step on which
it has timed both tiers: there the paper's warm-up of static copies is skipped (`_choose_tau`).

What runs: where a C compiler and Python's headers are found, the C kernel of spac_kernel.py
(spac_native.c) makes these decisions, one call per layer's plan and one per its finish, with
the eviction pool and the prefetch queue held in C; it decides exactly as the Python classes
below (estimator.py, balancer.py, queues.py), which run where it does not build, under
`MOESPEC_NATIVE=0`, without speculation (the ring of counts) and with `link_fetch`
(tests/test_offload_spac_kernel.py compares the two). The layer driver hands it its pins
and the unit times' update (`layer_kernel`). On Qwen3-30B-A3B shapes the driver's plan and
finish with it take 8.7 us per layer pass in the simulator (0.42 ms a step of 48 layers),
net of the clock's readings, on a 2-core AVX2 host, against ~200 us for the Python classes
there (benchmarks/results/policy_overhead_avx2.json, policy_overhead_prefetch_avx2.json).
Most of that is memory: called back to back, with the caches warm, the same calls take ~5
us, and ~36 us after 4 MiB of other reads; each call therefore starts by prefetching the
layer's rows, so their misses overlap (10.6 us before).
"""

from dataclasses import dataclass, replace
from itertools import accumulate

import numpy as np

from moespec.offload.policies import spac_kernel
from moespec.offload.policies.balancer import WorkloadBalancer, link_fetches
from moespec.offload.policies.base import EMPTY, LayerPlan, OffloadPolicy
from moespec.offload.policies.estimator import READINGS, UtilityEstimator
from moespec.offload.policies.queues import EvictionPool, PrefetchQueue


@dataclass(frozen=True)
class SpAcConfig:
    max_utility: int | None = None  # K; None: ceil(log2(gamma + 1))
    forgetting: float = 0.1  # lambda
    # The estimator reading (estimator.READINGS "count-unit"): Delta = f - u as the authors'
    # release, fixed boundaries (1, 1). adaptive_bounds=True: the paper's calibrated ones.
    adaptive_bounds: bool = False
    fixed_bounds: tuple[float, float] = (1.0, 1.0)
    reference: str = "count"  # what Delta compares f with: count, level, previous (estimator)
    balancer: bool = True  # False: tau = static_tau at every layer and step
    static_tau: int = 2  # also the tau of the warm-up (tiers of their own; see _choose_tau)
    prefetch: bool = True  # False: static placement from the fit split, no copies
    evict: bool = True  # False: keep what is cached until the cache is full
    speculative: bool = True  # False: plain decoding, utility over a window of tokens
    window_tokens: int = 10  # the window without speculation
    warmup_steps: int = 8  # steps before the balancer starts (it learns from the first step)
    link_fetch: bool = False  # beyond the paper: misses copied on demand when that is sooner


ABLATIONS: dict[str, SpAcConfig] = {
    "spac": SpAcConfig(),
    "spac-no-estimator": SpAcConfig(max_utility=1),
    "spac-fixed-bounds": SpAcConfig(adaptive_bounds=False, fixed_bounds=(3.0, 1.0)),
    "spac-static-tau": SpAcConfig(balancer=False),
    "spac-no-prefetch": SpAcConfig(prefetch=False),
    "spac-no-evict": SpAcConfig(evict=False),
    "spac-no-sd": SpAcConfig(speculative=False),
    "spac-literal-delta": SpAcConfig(reference="previous", adaptive_bounds=True),
    # Other readings of the estimator (estimator.READINGS).
    "spac-release": SpAcConfig(fixed_bounds=(5.0, 1.0), max_utility=5),
    "spac-count-adaptive": SpAcConfig(adaptive_bounds=True),
    "spac-level": SpAcConfig(reference="level", adaptive_bounds=True),
    # Beyond the paper: the link as a third resource of the balancer (balancer.link_fetches).
    "spac-link": SpAcConfig(link_fetch=True),
}


def reading_config(reading: str, **fields) -> SpAcConfig:
    """SpAc's config with the estimator reading `reading` (a key of estimator.READINGS)."""
    if reading not in READINGS:
        raise ValueError(f"unknown estimator reading {reading!r} (known: {', '.join(READINGS)})")
    reference, adaptive, bounds, max_utility = READINGS[reading]
    return SpAcConfig(
        reference=reference,
        adaptive_bounds=adaptive,
        fixed_bounds=bounds,
        max_utility=max_utility,
        **fields,
    )


class SpAcPolicy(OffloadPolicy):
    """`native`: None runs the C kernel where it builds and covers the config (speculative,
    no link fetches), else these Python classes; False always the Python; True the C or an
    error saying why not."""

    def __init__(
        self, config: SpAcConfig | None = None, name: str = "spac", native: bool | None = None
    ):
        self.config = config or SpAcConfig()
        self.name = name
        self.speculative = self.config.speculative
        self.native = native
        self._kernel = None

    def reset(self, cache, *, draft_length: int, top_k: int) -> None:
        cfg, layers, experts = self.config, cache.num_layers, cache.num_experts
        if not cfg.prefetch and getattr(self, "frequencies_", None) is None:
            raise ValueError(f"{self.name}: static placement needs fit(trace) first")
        window = draft_length + 1 if cfg.speculative else cfg.window_tokens
        self.estimator = UtilityEstimator(
            layers,
            experts,
            window_tokens=window,
            max_utility=cfg.max_utility,
            forgetting=cfg.forgetting,
            adaptive=cfg.adaptive_bounds,
            fixed_bounds=cfg.fixed_bounds,
            reference=cfg.reference,
        )
        k = self.estimator.max_utility
        self.balancer = WorkloadBalancer(layers, k, cfg.warmup_steps)
        self.tau = np.full(layers, min(max(cfg.static_tau, 1), k), dtype=np.int64)
        # Without speculation, f is the count over the last `window` tokens: a ring of counts.
        self._ring = np.zeros((1 if cfg.speculative else window, layers, experts))
        self._step, self._n_tokens, self._cancelled = 0, 1, 0
        self.bind(cache, draft_length=draft_length, top_k=top_k)
        self._kernel = None
        if self._use_kernel():  # the pool and queue live in C; the arrays above are shared
            self.queue = self.pool = None
            self._kernel = spac_kernel.make_state(self, cache)
        else:
            self.queue = PrefetchQueue(layers, experts, k)
            self.pool = EvictionPool(layers, experts, k, cache.expert_bytes)
        if getattr(self, "frequencies_", None) is not None:
            self.preload(self.frequencies_)

    def _use_kernel(self) -> bool:
        cfg = self.config
        if self.native is False:
            return False
        covered = cfg.speculative and not cfg.link_fetch  # the ring and link fetches: Python
        if self.native and not (covered and spac_kernel.available()):
            why = spac_kernel.why_unavailable() or "its config needs the Python classes"
            raise RuntimeError(f"{self.name}: no C kernel ({why})")
        return covered and spac_kernel.available()

    def layer_kernel(self):
        return self._kernel

    @property
    def cancelled(self) -> int:
        """Prefetches cancelled because their layer came before they started."""
        return self._kernel.counters()[1] if self._kernel is not None else self._cancelled

    def admitted(self, layer: int, expert: int) -> None:
        if self._kernel is not None:
            self._kernel.admitted(layer, expert)
            return
        self.pool.add(layer, expert, int(self.estimator.utility[layer, expert]))

    def begin_step(self, n_tokens: int) -> None:
        self._n_tokens = n_tokens
        if self._kernel is not None:
            self._kernel.set_step(self._step, n_tokens)

    def plan_layer(self, layer, experts, counts, now) -> LayerPlan:
        if self._kernel is not None:
            accelerator, cpu, _ = self._kernel.plan(layer, experts, counts, now, False)
            return LayerPlan(accelerator, cpu, EMPTY)
        u = self.estimator.utility[layer]
        self.balancer.record(layer, u[experts], counts)
        self._cancelled += self.queue.cancel_layer(layer)
        if self.tau[layer] > self.estimator.max_utility:  # tau = K + 1: nothing hot (serial)
            return LayerPlan(EMPTY, experts.astype(np.int64), EMPTY)
        cached = self.cache.present[layer, experts]
        resident, misses = experts[cached], experts[~cached]
        self.pool.move_many(layer, resident.tolist(), u[resident].tolist())  # used now: last
        fetch = self._link_fetches(layer, misses, counts[~cached], now)
        if not len(fetch):
            return LayerPlan(resident.astype(np.int64), misses.astype(np.int64), EMPTY)
        accelerator = np.concatenate([resident, fetch]).astype(np.int64)
        return LayerPlan(accelerator, np.setdiff1d(misses, fetch), fetch)

    def _link_fetches(self, layer, misses, counts, now) -> np.ndarray:
        """The misses to copy on demand (spac-link only), hottest first; see link_fetches."""
        times = self.unit_times
        cpu_expert, copy = times.cpu_per_expert, times.copy_per_expert
        if not self.config.link_fetch or not len(misses) or None in (cpu_expert, copy):
            return EMPTY
        order = np.argsort(-counts, kind="stable")
        arriving = self.cache.present & (self.cache.ready_at > now)
        j = link_fetches(
            np.full(len(misses), cpu_expert),  # the mean CPU expert: weight reads dominate
            link_backlog=int(arriving.sum()) * copy,
            copy_seconds=copy,
            accelerator_seconds=times.accelerator_per_expert or 0.0,
        )
        return misses[order[:j]].astype(np.int64)

    def end_layer(self, layer, experts, counts) -> None:
        if self._kernel is not None:
            self._kernel.end_layer(layer, experts, counts, self.cache.used_bytes)
            return
        frequency = self._window_frequency(layer, experts, counts)
        old = self.estimator.utility[layer].copy()
        u = self.estimator.update(layer, frequency)
        present = self.cache.present[layer]
        moved = np.flatnonzero(present & (u != old))
        self.pool.move_many(layer, moved.tolist(), u[moved].tolist())
        if not self.config.prefetch:
            return
        tau = self.tau[layer] = self._choose_tau(layer)
        if tau > self.estimator.max_utility:  # nothing hot: nothing to prefetch
            return
        hot = np.flatnonzero((u >= tau) & ~present)
        hot = hot[np.argsort(-u[hot], kind="stable")]
        self.queue.push_many(layer, hot.tolist(), u[hot].tolist())

    def _window_frequency(self, layer, experts, counts) -> np.ndarray:
        if self.speculative:  # the window is the pass
            f = np.zeros(self.cache.num_experts)
            f[experts] = counts
            return f
        ring = self._ring
        slot = self._step % len(ring)
        ring[slot, layer] = 0
        ring[slot, layer, experts] = counts
        return ring[:, layer].sum(axis=0) if len(ring) > 1 else ring[0, layer]

    def _choose_tau(self, layer: int) -> int:
        cfg, times = self.config, self.unit_times
        k = self.estimator.max_utility
        static = min(max(cfg.static_tau, 1), k)
        known = (times.cpu_per_slot, times.accelerator_per_expert, times.mean_layer_seconds(layer))
        if not cfg.balancer:
            return static
        # Beyond the paper: where the tiers share one processor (serial > 0), the balancer's
        # objective charges each copy to the compute's cores, so it needs no warm-up of
        # static copies: it starts as soon as both tiers have been timed. Until a copy has
        # been timed there, a copy is taken to cost what computing the expert on the CPU
        # does: it reads the same bytes (and writes them too), so this is a lower bound.
        serial = 1.0 - self.tier_overlap
        warmup = cfg.warmup_steps if serial <= 0 else 0
        if self._step < warmup or None in known:
            return static
        per_copy = times.copy_per_expert
        if per_copy is None and serial > 0:
            per_copy = times.cpu_per_expert
        # K + 1 levels: plain Python lists (numpy's per-call cost dominates arrays this small)
        u = self.estimator.utility[layer]
        absent_levels = np.bincount(u[~self.cache.present[layer]], minlength=k + 1).tolist()
        prefetch_counts = list(accumulate(reversed(absent_levels)))[::-1][1:]  # n(tau), 1..K
        # VRAM left(tau): free bytes plus the cached bytes of utility below tau.
        free, w = self.cache.free_bytes, int(self.cache.expert_bytes[layer])
        if cfg.evict:
            below = self.pool.bytes_below()  # [K]: bytes at levels < tau
            memory_capacity = [(free + b) / w for b in below]
        else:
            memory_capacity = [free / w] * k
        window = known[2] + (times.draft_per_token or 0.0) * self.draft_length / len(self.tau)
        io_capacity = window / per_copy if per_copy else float("inf")
        choice = self.balancer.choose(
            layer,
            prefetch_counts=prefetch_counts,
            memory_capacity=memory_capacity,
            io_capacity=io_capacity,
            slots=self._n_tokens * self.top_k,
            cpu_per_slot=known[0],
            gpu_per_expert=known[1],
            serial=serial,  # beyond the paper: tiers on one processor
            copy_seconds=per_copy or 0.0,
            split_seconds=(times.split_seconds or 0.0) if serial > 0 else 0.0,
        )
        return choice.tau

    def end_step(self, accepted: int) -> None:
        self._step += 1
        if self._kernel is not None:
            self._kernel.set_step(self._step, self._n_tokens)

    def next_prefetch(self):
        if self._kernel is not None:
            return self._kernel.next_prefetch()
        while (item := self.queue.pop()) is not None:
            if not self.cache.present[item]:
                return item
        return None

    def has_prefetch(self) -> bool:
        if self._kernel is not None:
            return self._kernel.counters()[0] > 0
        return len(self.queue) > 0

    def choose_victim(self, layer, expert, now):
        if self._kernel is not None:
            return self._kernel.victim(layer, expert, now)
        if not self.config.evict:
            return None
        incoming = int(self.estimator.utility[layer, expert])
        key = self.pool.victim(incoming, lambda lv, ev: self.cache.evictable(lv, ev, now))
        if key is not None:
            self.pool.remove(*key)
        return key

    def predicted_hot(self, layer: int) -> np.ndarray:
        return self.estimator.utility[layer] >= 1  # seed 003 §4.3: threshold 1

    def stats(self) -> dict:
        if getattr(self, "balancer", None) is None:  # not reset on a cache: nothing decided
            return {
                "max_utility": None,
                "mean_tau": None,
                "balancer_choices": 0,
                "balancer_none_hot": 0,
                "balancer_infeasible": 0,
                "cancelled_prefetches": 0,
            }
        b = self.balancer
        choices, tau_sum, infeasible, none_hot = b.choices, b.tau_sum, b.infeasible, b.none_hot
        if self._kernel is not None:
            choices, tau_sum, infeasible, none_hot = self._kernel.counters()[2:]
        return {
            "max_utility": self.estimator.max_utility,
            # tau = K + 1 (tiers on one processor): nothing hot, the layer whole on the CPU
            "mean_tau": tau_sum / choices if choices else float(self.tau.mean()),
            "balancer_choices": choices,
            "balancer_none_hot": none_hot,
            "balancer_infeasible": infeasible,
            "cancelled_prefetches": self.cancelled,
        }


def spac_variant(name: str, **overrides) -> SpAcPolicy:
    """A SpAc policy by ablation name (see ABLATIONS), with config fields overridden."""
    if name not in ABLATIONS:
        raise ValueError(f"unknown SpAc variant {name!r} (known: {', '.join(ABLATIONS)})")
    return SpAcPolicy(replace(ABLATIONS[name], **overrides), name=name)
