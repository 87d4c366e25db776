"""LRU's and hybrid's quicker victim searches and CPU split decide as the plain ones they
replaced: driven through the layer driver on random traces with copies still arriving, every
placement, eviction and count is the same."""

from collections import OrderedDict

import numpy as np
import pytest

from moespec.offload.driver import LayerDriver
from moespec.offload.policies.base import ExpertCache, LayerPlan
from moespec.offload.policies.baselines import HybridPolicy, LRUPolicy
from tests.layer_timings import random_timing

LAYERS, EXPERTS, TOP_K, TOKENS = 5, 24, 4, 4


class PlainLRU(LRUPolicy):
    """The victim search as a scan of each layer's order, the layers sorted fullest first."""

    def reset(self, cache, *, draft_length, top_k):
        self._order = [OrderedDict() for _ in range(cache.num_layers)]
        super(LRUPolicy, self).reset(cache, draft_length=draft_length, top_k=top_k)

    def admitted(self, layer, expert):
        self._order[layer][expert] = None

    def choose_victim(self, layer, expert, now):
        if (victim := self._plain_victim_in(layer, now)) is not None:
            return victim
        fullest = sorted(range(len(self._order)), key=lambda lv: -len(self._order[lv]))
        for victim_layer in fullest:
            if (victim := self._plain_victim_in(victim_layer, now)) is not None:
                return victim
        return None

    def _plain_victim_in(self, layer, now):
        order = self._order[layer]
        for e in order:
            if self.cache.evictable(layer, e, now):
                del order[e]
                return layer, e
        return None


class PlainHybrid(HybridPolicy):
    """The CPU split by np.setdiff1d and the victim over the masks at once."""

    def plan_layer(self, layer, experts, counts, now):
        self._queue.clear()
        cached = self.cache.present[layer, experts]
        absent, absent_counts = experts[~cached], counts[~cached]
        hot = absent[np.argsort(-absent_counts)]
        taken = self._greedy_fetch(int(cached.sum()), hot)
        fetch = np.array([int(hot[j]) for j in taken], dtype=np.int64)
        on_cpu = np.setdiff1d(absent, fetch)
        self._prefetch_next(layer)
        return LayerPlan(np.concatenate([experts[cached], fetch]), on_cpu, fetch)

    def choose_victim(self, layer, expert, now):
        c = self.cache
        can_leave = c.present & ~c.pinned & (c.ready_at <= now)
        if not can_leave.any():
            return None
        return divmod(int(np.argmin(np.where(can_leave, self.scores, np.inf))), c.num_experts)


class _Link:
    """Copies arrive `delay` seconds after they start: some are still arriving when asked."""

    def __init__(self, delay):
        self.delay = delay

    def arrival(self, layer, now):
        return now + self.delay

    def copy_started(self, layer, expert, kind):
        pass

    def evicted(self, layer, expert):
        pass


def _run(policy, seed, ratio, delay):
    rng = np.random.default_rng(seed)
    popularity = rng.dirichlet(np.full(EXPERTS, 0.4), size=LAYERS)
    fit = rng.integers(0, 5, size=(LAYERS, EXPERTS))
    policy.frequencies_ = fit
    expert_bytes = [100, 150, 100, 100, 120]
    cache = ExpertCache(expert_bytes, EXPERTS, int(ratio * EXPERTS * sum(expert_bytes)))
    driver = LayerDriver(cache, policy, _Link(delay), log=[])
    driver.start(draft_length=TOKENS - 1, top_k=TOP_K, tier_overlap=1.0)
    decisions, now = [], 0.0
    for _ in range(25):
        n = int(rng.integers(1, TOKENS + 1))
        policy.begin_step(n)
        for layer in range(LAYERS):
            row = np.bincount(
                np.concatenate(
                    [
                        rng.choice(EXPERTS, TOP_K, replace=False, p=popularity[layer])
                        for _ in range(n)
                    ]
                ),
                minlength=EXPERTS,
            )
            experts = np.flatnonzero(row)
            counts = row[experts]
            now += float(rng.random()) * 0.2
            for _ in range(int(rng.integers(0, 3))):
                decisions.append(("prefetch", driver.pull(now)))
            placed = driver.plan(
                layer, experts, counts, now, lambda l, e, t: driver.admit(l, e, "fetch", t)
            )
            decisions.append(
                (placed.accelerator.tolist(), placed.cpu.tolist(), placed.fetch.tolist())
            )
            timing = random_timing(rng, layer, placed, row)
            driver.finish(layer, experts, counts, placed, timing)
        policy.end_step(n - 1)
    decisions.append((cache.present.tolist(), cache.used_bytes, cache.peak_bytes))
    return decisions, driver.stats.to_dict(), driver.log


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("ratio", [0.15, 0.3])
@pytest.mark.parametrize("delay", [0.0, 0.5])
def test_lru_decides_as_the_plain_scan(seed, ratio, delay):
    quick = _run(LRUPolicy(), seed, ratio, delay)
    assert quick == _run(PlainLRU(), seed, ratio, delay)
    assert quick[1]["fetches"] > 0 and any(e[0] == "evict" for e in quick[2])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("ratio", [0.15, 0.3])
@pytest.mark.parametrize("delay", [0.0, 0.5])
def test_hybrid_decides_as_the_plain_masks(seed, ratio, delay):
    quick = _run(HybridPolicy(), seed, ratio, delay)
    assert quick == _run(PlainHybrid(), seed, ratio, delay)
    assert quick[1]["fetches"] > 0 and quick[1]["prefetches"] > 0
