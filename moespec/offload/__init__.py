"""Offloaded experts, by role:

    policies/  pure decisions: the policy protocol, MoE-SpAc (estimator, balancer, queues),
               the baselines
    driver.py  the clock-agnostic layer driver: plan check, pins, fetch / CPU fallback,
               admit / evict, `OffloadStats`, the cache budget rule
    engine/    the driver's real back end: host store, device slots, copy thread
    sim/       the driver's virtual back end: clock, timing model, hardware profiles

policy = make_policy("spac").fit(fit_trace)
result = simulate(trace, policy, get_profile("rtx4090-pcie4"), SimulationSettings(...))
"""

from moespec.offload.driver import LayerDriver, OffloadStats, expert_cache_budget
from moespec.offload.policies.base import ExpertCache, LayerPlan, LayerTiming, OffloadPolicy
from moespec.offload.policies.baselines import (
    HybridPolicy,
    LayerStaticPolicy,
    LRUPolicy,
    StaticPolicy,
)
from moespec.offload.policies.spac import ABLATIONS, SpAcConfig, SpAcPolicy, spac_variant
from moespec.offload.sim.hardware import (
    PROFILES,
    HardwareProfile,
    get_profile,
    measure_this_machine,
)
from moespec.offload.sim.simulator import SimulationResult, SimulationSettings, simulate

BASELINES = {
    "lru": LRUPolicy,
    "static": StaticPolicy,
    "static-layers": LayerStaticPolicy,
    "hybrid": HybridPolicy,
}
POLICY_NAMES = ["spac", "lru", "static", "static-layers", "hybrid", "spac-ar"]


def make_policy(name: str) -> OffloadPolicy:
    """A fresh policy by name: spac, lru, static, hybrid, spac-ar, a SpAc ablation, or a
    baseline with "-ar" (lru-ar, static-ar, hybrid-ar): the same policy without speculation."""
    if name in BASELINES:
        return BASELINES[name]()
    if name.endswith("-ar") and name[:-3] in BASELINES:
        policy = BASELINES[name[:-3]]()
        policy.name, policy.speculative = name, False
        return policy
    if name == "spac-ar":
        policy = spac_variant("spac-no-sd")
        policy.name = "spac-ar"
        return policy
    if name in ABLATIONS:
        return spac_variant(name)
    ar = [f"{b}-ar" for b in BASELINES]
    known = ", ".join([*POLICY_NAMES, *ar, *[a for a in ABLATIONS if a != "spac"]])
    raise ValueError(f"unknown policy {name!r} (known: {known})")


__all__ = [
    "ABLATIONS",
    "BASELINES",
    "POLICY_NAMES",
    "PROFILES",
    "ExpertCache",
    "HardwareProfile",
    "HybridPolicy",
    "LRUPolicy",
    "LayerDriver",
    "LayerStaticPolicy",
    "LayerPlan",
    "LayerTiming",
    "OffloadPolicy",
    "OffloadStats",
    "SimulationResult",
    "SimulationSettings",
    "SpAcConfig",
    "SpAcPolicy",
    "StaticPolicy",
    "expert_cache_budget",
    "get_profile",
    "make_policy",
    "measure_this_machine",
    "simulate",
    "spac_variant",
]
