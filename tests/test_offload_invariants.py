"""Invariants every offload policy keeps on any routing (Hypothesis), read from the simulator's log:
the cache never exceeds its budget, no expert in use is evicted, every needed expert is computed
exactly once per layer, and the bytes moved are the bytes of the copies scheduled."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moespec.offload import POLICY_NAMES, get_profile, make_policy, simulate
from moespec.offload.sim.simulator import SimulationSettings
from moespec.routing import RoutingTrace

EVERY_POLICY = [
    *POLICY_NAMES,
    "lru-ar",
    "static-ar",
    "hybrid-ar",
    "spac-no-estimator",
    "spac-fixed-bounds",
    "spac-static-tau",
    "spac-no-prefetch",
    "spac-no-evict",
    "spac-literal-delta",
    "spac-release",
    "spac-count-adaptive",
    "spac-level",
    "spac-link",
]


def markov_trace(tokens, layers, experts, top_k, stay, seed, docs=1, expert_bytes=None):
    """Sticky routing: each slot keeps the previous token's expert with probability `stay`,
    the others are drawn from a skewed popularity, distinct within the token."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((tokens, layers, top_k), dtype=np.int64)  # [T, L, m]
    for layer in range(layers):
        popularity = rng.dirichlet(np.full(experts, 0.5))
        previous = rng.choice(experts, top_k, replace=False)
        for t in range(tokens):
            chosen = list(dict.fromkeys(previous[rng.random(top_k) < stay]))
            while len(chosen) < top_k:
                e = int(rng.choice(experts, p=popularity))
                if e not in chosen:
                    chosen.append(e)
            ids[t, layer] = previous = np.array(chosen)
    starts = np.linspace(0, tokens, docs + 1).astype(int)
    return RoutingTrace(
        expert_ids=ids,
        doc_starts=starts,
        doc_names=[f"doc{d}" for d in range(docs)],
        num_experts=experts,
        expert_bytes=expert_bytes or [3 * 10**6] * layers,
        layer_indices=list(range(layers)),
    )


@st.composite
def scenarios(draw):
    layers, experts = draw(st.integers(1, 3)), draw(st.integers(3, 10))
    top_k = draw(st.integers(1, min(3, experts - 1)))
    trace = markov_trace(
        tokens=draw(st.integers(24, 60)),
        layers=layers,
        experts=experts,
        top_k=top_k,
        stay=draw(st.floats(0, 0.9)),
        seed=draw(st.integers(0, 10**6)),
        docs=draw(st.integers(1, 3)),
        expert_bytes=[draw(st.sampled_from([10**6, 3 * 10**6])) for _ in range(layers)],
    )
    run = SimulationSettings(
        cache_ratio=draw(st.sampled_from([0.0, 0.1, 0.3, 0.6, 1.0])),
        draft_length=draw(st.integers(0, 5)),
        acceptance=draw(st.floats(0, 0.95)),
        tokens=200,
        seed=draw(st.integers(0, 100)),
        fit_tokens=8,
        record=True,
    )
    return draw(st.sampled_from(EVERY_POLICY)), trace, run


def run_logged(name, trace, run):
    policy = make_policy(name).fit(trace.first_tokens(run.fit_tokens))
    return simulate(trace, policy, get_profile("rtx4090-pcie4"), run)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_every_needed_expert_is_computed_exactly_once_per_layer(scenario):
    result = run_logged(*scenario)
    for record in result.log["layers"]:
        placed = np.concatenate([record["accelerator"], record["cpu"]])
        assert len(placed) == len(set(placed.tolist())) == len(record["needed"])
        assert set(placed.tolist()) == set(record["needed"].tolist())
        assert set(record["fetch"].tolist()) <= set(record["accelerator"].tolist()) | set(
            record["cpu"].tolist()
        )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_the_cache_never_exceeds_its_budget(scenario):
    name, trace, run = scenario
    result = run_logged(name, trace, run)
    w = trace.expert_bytes
    used = result.preload_bytes
    for event in result.log["events"]:
        used += w[event[2]] if event[0] == "copy" else -w[event[2]]
        assert 0 <= used <= result.budget_bytes
    assert result.peak_cache_bytes <= result.budget_bytes


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_no_expert_is_evicted_while_its_layer_computes_with_it(scenario):
    result = run_logged(*scenario)
    layers = result.log["layers"]
    for kind, time, layer, expert, *_ in result.log["events"]:
        if kind != "evict":
            continue
        for record in layers:
            if record["layer"] == layer and record["start"] <= time < record["end"]:
                assert expert not in record["accelerator"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_bytes_copied_are_the_bytes_of_the_copies_scheduled(scenario):
    result = run_logged(*scenario)
    copies = [e for e in result.log["events"] if e[0] == "copy"]
    assert result.stats.bytes_copied == sum(e[4] for e in copies)
    assert result.stats.copies == len(copies)
    fetches = sum(len(r["fetch"]) for r in result.log["layers"])
    assert result.stats.fetches + result.stats.fallbacks == fetches


def test_a_simulation_is_deterministic_for_a_seed():
    trace = markov_trace(80, 2, 8, 2, 0.5, seed=3)
    run = SimulationSettings(cache_ratio=0.3, tokens=60, seed=5, fit_tokens=10)
    for name in ["spac", "hybrid", "lru"]:
        first = run_logged(name, trace, run).to_dict()
        assert run_logged(name, trace, run).to_dict() == first


def test_every_policy_sees_the_same_steps_for_a_seed():
    trace = markov_trace(120, 2, 8, 2, 0.5, seed=4)
    run = SimulationSettings(cache_ratio=0.3, tokens=100, seed=9, fit_tokens=10)
    steps = {name: run_logged(name, trace, run).steps for name in ["spac", "lru", "static"]}
    assert len(set(steps.values())) == 1
