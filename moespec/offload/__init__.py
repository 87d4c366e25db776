"""Offloaded experts: cache policies (MoE-SpAc and baselines) and a trace-driven simulator.

policy = make_policy("spac").fit(fit_trace)
result = simulate(trace, policy, get_profile("rtx4090-pcie4"), SimulationSettings(...))
"""

from moespec.offload.baselines import HybridPolicy, LRUPolicy, StaticPolicy
from moespec.offload.hardware import PROFILES, HardwareProfile, get_profile, measure_this_machine
from moespec.offload.policy import ExpertCache, LayerPlan, LayerTiming, OffloadPolicy
from moespec.offload.simulator import SimulationResult, SimulationSettings, simulate
from moespec.offload.spac import ABLATIONS, SpAcConfig, SpAcPolicy, spac_variant

BASELINES = {"lru": LRUPolicy, "static": StaticPolicy, "hybrid": HybridPolicy}
POLICY_NAMES = ["spac", "lru", "static", "hybrid", "spac-ar"]


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
    "LayerPlan",
    "LayerTiming",
    "OffloadPolicy",
    "SimulationResult",
    "SimulationSettings",
    "SpAcConfig",
    "SpAcPolicy",
    "StaticPolicy",
    "get_profile",
    "make_policy",
    "measure_this_machine",
    "simulate",
    "spac_variant",
]
