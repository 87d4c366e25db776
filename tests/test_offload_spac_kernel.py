"""SpAc's C kernel (spac_kernel.py) decides as its Python classes do: the same placements,
prefetches, victims, utilities, thresholds and counts, on random traces and timings."""

from dataclasses import replace

import numpy as np
import pytest

from moespec.offload.driver import LayerDriver
from moespec.offload.policies import spac_kernel
from moespec.offload.policies.base import ExpertCache
from moespec.offload.policies.spac import ABLATIONS, SpAcPolicy
from tests.layer_timings import random_timing

needs_kernel = pytest.mark.skipif(
    not spac_kernel.available(), reason=f"no SpAc kernel: {spac_kernel.why_unavailable()}"
)
LAYERS, EXPERTS, TOP_K, TOKENS = 4, 16, 3, 5


class _Link:
    """A back end whose copies arrive 0.3 s after they start (some are arriving when asked)."""

    def arrival(self, layer, now):
        return now + 0.3

    def copy_started(self, layer, expert, kind):
        pass

    def evicted(self, layer, expert):
        pass


def _run(policy: SpAcPolicy, seed: int, tier_overlap: float, fused: bool = True, steps=30):
    """Drive `policy` through the layer driver on a random skewed routing with random timings;
    every decision it makes, in order."""
    rng = np.random.default_rng(seed)
    popularity = rng.dirichlet(np.full(EXPERTS, 0.3), size=LAYERS)  # [L, N]
    fit = rng.integers(0, EXPERTS, size=(LAYERS, EXPERTS)) * (rng.random((LAYERS, EXPERTS)) < 0.4)
    policy.frequencies_ = fit
    expert_bytes = [100, 100, 150, 100]
    cache = ExpertCache(expert_bytes, EXPERTS, budget_bytes=int(0.3 * EXPERTS * 450))
    driver = LayerDriver(cache, policy, _Link(), log=[])
    driver.start(draft_length=TOKENS - 1, top_k=TOP_K, tier_overlap=tier_overlap)
    if not fused:
        driver.kernel = None  # the driver's own path over plan_layer / end_layer
    decisions, now = [], 0.0
    for _ in range(steps):
        n = int(rng.integers(1, TOKENS + 1))
        policy.begin_step(n)
        policy.observe_draft(float(rng.random()) * 1e-3, n - 1)
        for layer in range(LAYERS):
            routed = [
                rng.choice(EXPERTS, TOP_K, replace=False, p=popularity[layer]) for _ in range(n)
            ]
            row = np.bincount(np.concatenate(routed), minlength=EXPERTS)
            experts = np.flatnonzero(row)
            counts = row[experts]
            now += float(rng.random()) * 0.2
            for _ in range(int(rng.integers(0, 4))):  # the link takes some prefetches
                decisions.append(("prefetch", driver.pull(now)))
            placed = driver.plan(
                layer, experts, counts, now, lambda l, e, t: driver.admit(l, e, "fetch", t)
            )
            decisions.append(("plan", placed.accelerator.tolist(), placed.cpu.tolist()))
            timing = random_timing(rng, layer, placed, row, rest=True)
            driver.finish(layer, experts, counts, placed, timing)
            decisions.append(("tau", policy.tau.tolist(), policy.estimator.utility.tolist()))
            victim = policy.choose_victim(layer, int(experts[0]), now)
            if victim is not None:  # as the driver's admit does with one
                cache.evict(*victim, now=now)
            decisions.append(("victim", victim))
        policy.end_step(n - 1)
    decisions.append(("pinned", cache.pinned.any(), cache.present.tolist(), cache.used_bytes))
    return decisions, driver.stats.to_dict(), driver.log, policy.stats()


CONFIGS = ["spac", "spac-release", "spac-count-adaptive", "spac-level", "spac-literal-delta"]
CONFIGS += ["spac-no-estimator", "spac-static-tau", "spac-no-prefetch", "spac-no-evict"]


@needs_kernel
@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("tier_overlap", [1.0, 0.0, 0.4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_kernel_decides_as_the_python_classes(name, tier_overlap, seed):
    config = replace(ABLATIONS[name], warmup_steps=3)
    python = _run(SpAcPolicy(config, name, native=False), seed, tier_overlap)
    kernel = SpAcPolicy(config, name, native=True)
    native = _run(kernel, seed, tier_overlap)
    assert kernel.layer_kernel() is not None
    assert native == python


@needs_kernel
@pytest.mark.parametrize("seed", [3, 4])
def test_the_kernel_decides_alike_through_plan_layer_and_end_layer(seed):
    """Called as any policy (the driver's check, pins and unit times in Python)."""
    python = _run(SpAcPolicy(native=False), seed, 0.0)
    assert _run(SpAcPolicy(native=True), seed, 0.0, fused=False) == python


@needs_kernel
def test_the_kernel_refuses_a_routing_that_names_an_expert_twice():
    policy = SpAcPolicy(native=True)
    cache = ExpertCache([100] * LAYERS, EXPERTS, budget_bytes=500)
    LayerDriver(cache, policy, _Link()).start(draft_length=4, top_k=TOP_K)
    with pytest.raises(ValueError, match="distinct experts"):
        policy.plan_layer(0, np.array([1, 1]), np.array([1, 2]), 0.0)
    with pytest.raises(ValueError, match="distinct experts"):
        policy.plan_layer(0, np.array([EXPERTS]), np.array([1]), 0.0)


def test_without_the_kernel_spac_runs_its_python_classes(monkeypatch):
    monkeypatch.setattr(spac_kernel, "_load", lambda: (None, "no C compiler found"))
    cache = ExpertCache([100] * LAYERS, EXPERTS, budget_bytes=500)
    policy = SpAcPolicy()
    LayerDriver(cache, policy, _Link()).start(draft_length=4, top_k=TOP_K)
    assert policy.layer_kernel() is None and policy.pool is not None
    with pytest.raises(RuntimeError, match="no C compiler found"):
        SpAcPolicy(native=True).reset(cache, draft_length=4, top_k=TOP_K)


def test_configs_the_kernel_does_not_cover_run_in_python():
    cache = ExpertCache([100] * LAYERS, EXPERTS, budget_bytes=500)
    for name in ("spac-no-sd", "spac-link"):
        policy = SpAcPolicy(ABLATIONS[name], name)
        policy.reset(cache, draft_length=4, top_k=TOP_K)
        assert policy.layer_kernel() is None
