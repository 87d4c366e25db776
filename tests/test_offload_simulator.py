"""The simulator's timing model and speculative steps, on cases small enough to add up by hand."""

from dataclasses import replace

import numpy as np
import pytest

from moespec.offload import HardwareProfile, make_policy, simulate
from moespec.offload.sim.simulator import SimulationSettings
from moespec.routing import RoutingTrace

# Round numbers: a 1 MB expert copies in 1 ms, runs in 0.1 ms on the accelerator, 1 ms on the CPU.
ROUND = HardwareProfile(
    name="round",
    link_bandwidth=1e9,
    link_latency=0.0,
    accelerator_bandwidth=1e10,
    accelerator_flops=1e30,
    accelerator_expert_time=0.0,
    accelerator_memory=0.0,
    cpu_bandwidth=1e9,
    cpu_flops=1e30,
    cpu_expert_time=0.0,
    cpu_threads=1,
)


def one_layer_trace(experts_by_token, num_experts=4):
    ids = np.array(experts_by_token, dtype=np.int64)[:, None, None]  # [T, L=1, m=1]
    return RoutingTrace(ids, [0, len(ids)], ["doc"], num_experts, [10**6], [0])


def run(name, trace, **settings):
    run_settings = SimulationSettings(draft_bytes_ratio=0.0, **settings)
    policy = make_policy(name)
    if run_settings.fit_tokens:
        policy.fit(trace.first_tokens(run_settings.fit_tokens))
    return simulate(trace, policy, ROUND, run_settings)


def test_on_demand_lru_pays_one_copy_then_hits():
    # One expert of budget; token 1 misses (1 ms copy + 0.1 ms), tokens 2 and 3 hit (0.1 ms).
    result = run("lru", one_layer_trace([0] * 6), cache_ratio=0.25, draft_length=0, tokens=3)
    assert result.seconds == pytest.approx(1.3e-3)
    assert (result.stats.bytes_copied, result.hit_rate) == (10**6, pytest.approx(2 / 3))
    # the accelerator waited for the one copy (1 ms), and for nothing once it had arrived
    assert result.stats.copy_wait_seconds == pytest.approx(1e-3)


def test_a_kernel_call_is_not_counted_as_waiting_for_a_copy():
    called = replace(ROUND, kernel_call_time=0.3e-3)
    settings = SimulationSettings(cache_ratio=0.25, draft_length=0, tokens=3, draft_bytes_ratio=0)
    result = simulate(one_layer_trace([0] * 6), make_policy("lru"), called, settings)
    # token 1: the call (0.3 ms) is made while the copy runs, then 0.7 ms of waiting for it
    # and 0.1 ms of work; tokens 2 and 3: call and work, 0.4 ms each
    assert result.seconds == pytest.approx(1.9e-3)
    assert result.stats.copy_wait_seconds == pytest.approx(0.7e-3)


def test_static_placement_computes_the_cold_expert_on_the_cpu():
    # The fit split (tokens 0-1) makes expert 1 the one to place; the replay needs expert 0.
    trace = one_layer_trace([1, 1, 0, 0, 0, 0])
    result = run("static", trace, cache_ratio=0.25, draft_length=0, tokens=3, fit_tokens=2)
    assert result.seconds == pytest.approx(3e-3)
    assert (result.stats.bytes_copied, result.stats.cpu_experts, result.preload_bytes) == (
        0,
        3,
        10**6,
    )


def test_llamacpp_placement_holds_the_last_whole_layers_whatever_the_routing():
    # 4 layers of 4 one-MB experts; a 45% budget (7.2 MB) holds one whole layer, the last
    # (`--n-cpu-moe 3`), and no part of another, though the fit split makes layer 0's expert 1
    # the hottest expert of all. Every token is then a hit at layer 3 and a CPU expert elsewhere.
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 4, size=(40, 4, 1))
    ids[:10, 0, 0] = 1
    trace = RoutingTrace(ids, [0, 40], ["doc"], 4, [10**6] * 4, [0, 1, 2, 3])
    result = run("static-layers", trace, cache_ratio=0.45, draft_length=0, tokens=30, fit_tokens=10)
    assert result.preload_bytes == 4 * 10**6
    assert result.hit_rate == pytest.approx(0.25)
    assert (result.stats.bytes_copied, result.stats.cpu_experts) == (0, 90)
    # A token: three layers of one CPU expert (1 ms each), one of an accelerator expert (0.1 ms).
    assert result.seconds == pytest.approx(30 * 3.1e-3)
    popular = run("static", trace, cache_ratio=0.45, draft_length=0, tokens=30, fit_tokens=10)
    assert popular.preload_bytes == 7 * 10**6  # per expert: the budget's 7 hottest


def test_previous_pass_forecast_is_scored_beside_the_policy():
    # Plain decoding of experts 0, 0, 1, 1 of 4: the previous pass's forecast is right about
    # 3, 4, 2 and 4 of the 4 experts (nothing is active before the first pass).
    result = run("lru", one_layer_trace([0, 0, 1, 1]), cache_ratio=0.25, draft_length=0, tokens=4)
    assert result.previous_pass_accuracy == pytest.approx(13 / 16)
    assert result.to_dict()["previous_pass_hot_cold_accuracy"] == pytest.approx(13 / 16)


def test_rejected_drafts_still_cost_the_draft_and_a_verified_pass():
    # k = 2 at acceptance 0: each step drafts 2 tokens (0.1 ms each: 1 MB of draft at 10 GB/s)
    # and verifies 3 tokens of expert 0 on the CPU (1 ms, read once), but emits one token.
    # Rejected drafts routed like the continuation: expert 0 again.
    trace = one_layer_trace([0] * 12)
    settings = dict(
        cache_ratio=0.0,
        draft_length=2,
        acceptance=0.0,
        tokens=5,
        rejected_routing="continuation",
    )
    result = simulate(
        trace, make_policy("lru"), ROUND, SimulationSettings(draft_bytes_ratio=0.25, **settings)
    )
    assert result.steps == result.tokens == 5
    assert result.seconds == pytest.approx(5 * 1.2e-3)
    assert result.stats.fallbacks == 5  # no budget at all: the fetch cannot happen


def test_accepted_drafts_advance_the_trace():
    trace = one_layer_trace([0] * 400)
    result = run(
        "static", trace, cache_ratio=0.0, draft_length=3, acceptance=0.9, tokens=300, fit_tokens=1
    )
    # Geometric acceptance: E[tokens per step] = (1 - a^4) / (1 - a) = 3.439
    assert result.tokens == 300
    assert 300 / result.steps == pytest.approx(3.439, rel=0.1)


def test_plain_decoding_policies_take_one_token_per_step():
    trace = one_layer_trace([0, 1, 2, 3] * 20)
    result = run("spac-ar", trace, cache_ratio=0.5, draft_length=8, acceptance=0.9, tokens=40)
    assert result.steps == result.tokens == 40


def test_a_pass_never_crosses_a_document_end():
    ids = np.zeros((10, 1, 1), dtype=np.int64)
    trace = RoutingTrace(ids, [0, 2, 4, 6, 8, 10], list("abcde"), 4, [10**6], [0])
    result = run("lru", trace, cache_ratio=0.25, draft_length=8, acceptance=0.999999, tokens=10)
    assert (result.tokens, result.steps) == (10, 5)  # one pass per two-token document


def test_settings_are_checked():
    with pytest.raises(ValueError, match="cache ratio"):
        SimulationSettings(cache_ratio=1.5)
    with pytest.raises(ValueError, match="acceptance"):
        SimulationSettings(acceptance=1.0)


def test_static_placement_without_a_fit_is_refused():
    with pytest.raises(ValueError, match="fit"):
        simulate(
            one_layer_trace([0] * 4), make_policy("static"), ROUND, SimulationSettings(tokens=2)
        )


def test_rejected_drafts_are_routed_apart_from_the_continuation():
    # Every accepted token routes to expert 0; a rejected draft drawn from the fit split's
    # popularity (expert 0 only there, but one pseudo-count each) or given by a draft's
    # routing array reaches other experts, and only in the rejected positions.
    trace = one_layer_trace([0] * 40)
    base = dict(cache_ratio=1.0, draft_length=3, acceptance=0.0, tokens=20, fit_tokens=4)
    same = run("lru", trace, rejected_routing="continuation", **base)
    drawn = run("lru", trace, **base)
    assert same.stats.needed == same.steps  # one expert per pass
    assert drawn.stats.needed > drawn.steps
    draft = np.full_like(trace.expert_ids, 3)
    given = simulate(trace, make_policy("lru"), ROUND, SimulationSettings(**base), rejected=draft)
    assert given.stats.needed == 2 * given.steps  # expert 0 (accepted) and 3 (rejected)


def test_fixed_costs_are_paid_per_layer_and_per_step():
    # Expert 0 preloaded (static from the fit split): 0.1 ms per token, plus 0.5 ms of fixed
    # layer time and 0.2 ms of fixed step time.
    fixed = replace(ROUND, layer_time=0.5e-3, step_time=0.2e-3)
    trace = one_layer_trace([0] * 6)
    settings = SimulationSettings(
        cache_ratio=0.25, draft_length=0, tokens=3, fit_tokens=2, draft_bytes_ratio=0.0
    )
    policy = make_policy("static").fit(trace.first_tokens(2))
    result = simulate(trace, policy, fixed, settings)
    assert result.seconds == pytest.approx(3 * 0.8e-3)
    assert result.layer_ms == pytest.approx(0.6)  # the pass's layer: fixed + expert


def test_cpu_experts_slow_down_while_the_link_copies_from_host_memory():
    # One cache slot; the token needs experts 0 and 1: LRU fetches 0 (1 ms on the link) and
    # runs 1 on the CPU (1 ms of weight reads). Host memory serves 1.5 GB/s in all: while the
    # copy runs, the CPU reads at 0.5 GB/s and takes 2 ms; without sharing, 1.1 ms (the wait).
    ids = np.array([[[0, 1]]] * 3, dtype=np.int64)  # [T, L=1, m=2]
    trace = RoutingTrace(ids, [0, 3], ["doc"], 4, [10**6], [0])
    settings = SimulationSettings(cache_ratio=0.25, draft_length=0, tokens=1, draft_bytes_ratio=0)
    shared = replace(ROUND, host_memory_bandwidth=1.5e9)
    assert simulate(trace, make_policy("lru"), ROUND, settings).seconds == pytest.approx(1.1e-3)
    assert simulate(trace, make_policy("lru"), shared, settings).seconds == pytest.approx(2e-3)


def test_one_processor_for_both_tiers_adds_their_times():
    # Expert 1 placed (fit split), expert 0 on the CPU: a 2-token pass needs both, each 1 token.
    trace = one_layer_trace([1, 1, 0, 1, 0, 1, 0, 1])
    settings = SimulationSettings(
        draft_bytes_ratio=0.0, cache_ratio=0.25, draft_length=1, acceptance=0.0,
        tokens=1, fit_tokens=2, rejected_routing="continuation",
    )  # fmt: skip
    times = {}
    for overlap in (1.0, 0.0):
        profile = replace(ROUND, tier_overlap=overlap)
        policy = make_policy("static").fit(trace.first_tokens(2))
        times[overlap] = simulate(trace, policy, profile, settings).seconds
    # In parallel: max(0.1 ms accelerator, 1 ms CPU); taking turns: their sum.
    assert times[1.0] == pytest.approx(1.0e-3)
    assert times[0.0] == pytest.approx(1.1e-3)


def test_the_engines_bookkeeping_is_paid_per_layer_and_per_split():
    # Expert 1 placed (the fit split's tie of 1 and 3 goes to the lower id); the replay needs
    # 1 and 0 (both tiers), then 0 and 2 (the CPU tier only): 0.2 ms of bookkeeping a layer
    # pass, 0.3 ms more where it is split.
    trace = RoutingTrace(
        np.array([[[1, 3]]] * 2 + [[[1, 0]]] * 2 + [[[0, 2]]] * 2, dtype=np.int64),
        [0, 6], ["doc"], 4, [10**6], [0],
    )  # fmt: skip
    settings = SimulationSettings(
        draft_bytes_ratio=0.0, cache_ratio=0.25, draft_length=0, tokens=4, fit_tokens=2,
    )  # fmt: skip
    seconds = {}
    for extra in ((0.0, 0.0), (0.2e-3, 0.3e-3)):
        profile = replace(ROUND, offload_layer_time=extra[0], offload_split_time=extra[1])
        policy = make_policy("static").fit(trace.first_tokens(2))
        seconds[extra] = simulate(trace, policy, profile, settings).seconds
    # tokens 3 and 4 split (0.5 ms each), tokens 5 and 6 on the CPU alone (0.2 ms each)
    assert seconds[(0.2e-3, 0.3e-3)] - seconds[(0.0, 0.0)] == pytest.approx(1.4e-3)


def spac_on_two_layers(profile, tokens):
    """SpAc fitted on [1, 3] (both preloaded, 2 of 8 slots a layer), then replaying [1, 0]:
    expert 0 turns hot on the CPU, and 3 is a cached expert that is not used."""
    ids = np.array([[1, 3]] * 2 + [[1, 0]] * 40, dtype=np.int64)[:, None, :].repeat(2, axis=1)
    trace = RoutingTrace(ids, [0, len(ids)], ["doc"], 8, [10**6] * 2, [0, 1])
    settings = SimulationSettings(
        draft_bytes_ratio=0.0, cache_ratio=0.25, draft_length=3, acceptance=0.0,
        tokens=tokens, fit_tokens=2, rejected_routing="continuation",
    )  # fmt: skip
    return simulate(trace, make_policy("spac").fit(trace.first_tokens(2)), profile, settings)


def test_spac_on_one_processor_copies_nothing_that_cannot_pay():
    # Accelerator and CPU alike (1 ms an expert), taking turns: a copy (1 ms) makes no expert
    # faster. The paper's warm-up would prefetch expert 0 at the static threshold, as it
    # still does where the tiers are devices of their own; on one processor the balancer
    # starts at once, charges the copy to the compute and copies nothing.
    alike = replace(ROUND, accelerator_bandwidth=ROUND.cpu_bandwidth)
    for tokens in (8, 30):  # within the warm-up's 8 steps, and beyond
        own = spac_on_two_layers(alike, tokens)
        assert own.stats.bytes_copied == 2 * 10**6  # expert 0, once in each layer
        shared = spac_on_two_layers(replace(alike, tier_overlap=0.0), tokens)
        assert shared.stats.bytes_copied == 0
        # expert 0 on the CPU every step (expert 1 too, where a layer runs whole there)
        assert shared.stats.cpu_experts >= 2 * tokens


def test_spac_on_one_processor_runs_a_layer_whole_where_a_split_costs():
    # Tiers alike and taking turns, and a split layer costs 0.5 ms more (gather, scatter, a
    # second call): the balancer learns that cost from the timings and picks tau = K + 1,
    # the layer in one call on the CPU, cached expert 1 included, and beats static, which
    # must split every layer. With tiers of their own, cached experts stay on the accelerator.
    alike = replace(ROUND, accelerator_bandwidth=ROUND.cpu_bandwidth, tier_overlap=0.0)
    costly = replace(alike, offload_split_time=0.5e-3)
    result = spac_on_two_layers(costly, tokens=30)
    assert result.stats.bytes_copied == 0
    assert result.stats.cpu_experts >= 2 * 2 * 30 - 2 * 3  # both experts, all but the first steps
    assert result.policy_stats["balancer_none_hot"] >= 2 * 30 - 2 * 3  # tau = K + 1 those steps
    ids = np.array([[1, 3]] * 2 + [[1, 0]] * 40, dtype=np.int64)[:, None, :].repeat(2, axis=1)
    trace = RoutingTrace(ids, [0, len(ids)], ["doc"], 8, [10**6] * 2, [0, 1])
    settings = SimulationSettings(
        draft_bytes_ratio=0.0, cache_ratio=0.25, draft_length=3, acceptance=0.0, tokens=30,
        fit_tokens=2, rejected_routing="continuation",
    )  # fmt: skip
    static = simulate(trace, make_policy("static").fit(trace.first_tokens(2)), costly, settings)
    assert static.stats.cpu_experts == 2 * 30  # expert 0 on the CPU, expert 1 cached: a split
    assert result.seconds < static.seconds
    own = spac_on_two_layers(replace(costly, tier_overlap=1.0), tokens=30)
    assert own.stats.cpu_experts < 2 * 30  # expert 1 on the accelerator, expert 0 copied
    assert own.policy_stats["balancer_none_hot"] == 0  # not a candidate for tiers of their own


def test_spac_on_one_processor_still_copies_what_pays_from_the_first_steps():
    # The ROUND accelerator is 10x the CPU: expert 0's copy pays back, and on one processor
    # the balancer takes it within the 8 steps the paper's warm-up would have waited.
    result = spac_on_two_layers(replace(ROUND, tier_overlap=0.0), tokens=8)
    assert result.stats.bytes_copied == 2 * 10**6
    assert result.stats.cpu_experts < 2 * 8


def test_given_accepted_drafts_replace_the_seeded_draws():
    trace = one_layer_trace([0] * 40)
    given = (3, 0, 1, 3)
    result = run("lru", trace, cache_ratio=1.0, draft_length=3, tokens=9, accepted=given)
    # Steps emit accepted + 1 tokens: 4 + 1 + 2 + 2 (the last cut at 9 tokens).
    assert (result.steps, result.tokens) == (4, 9)


def test_decisions_on_the_clock_only_add_time():
    trace = one_layer_trace([0, 1, 2, 3] * 8, num_experts=4)
    settings = SimulationSettings(draft_bytes_ratio=0.0, cache_ratio=0.25, draft_length=0,
                                  tokens=16)  # fmt: skip
    seconds = {}
    for on_clock in (False, True):
        profile = replace(ROUND, decisions_on_clock=on_clock)
        seconds[on_clock] = simulate(trace, make_policy("lru"), profile, settings).seconds
    assert seconds[True] > seconds[False]


def test_this_machine_profile_is_measured_with_the_engine_kernel(tmp_path):
    """`this-machine`: both tiers are this CPU, timed through moespec's expert kernels; the
    profile's figures are positive, its overlap a share, and it reads back from JSON."""
    import json
    import math

    from moespec.offload.sim.hardware import load_profile, measure_this_machine

    profile = measure_this_machine(
        hidden_size=256, intermediate_size=64, repeats=2, kernel="slot", store_bytes=1 << 21,
        pool_bytes=1 << 20,
    )  # fmt: skip
    assert profile.cpu_bandwidth == profile.accelerator_bandwidth > 0
    assert math.isfinite(profile.cpu_bandwidth) and profile.link_bandwidth > 0
    # the link through the engine's copy thread: a hand-off time and a finite copy rate
    assert math.isfinite(profile.link_bandwidth) and 0 <= profile.link_latency < 0.1
    assert profile.cpu_expert_time >= 0 and profile.kernel_call_time >= 0
    assert 0.0 <= profile.tier_overlap <= 1.0
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile.to_dict()))
    assert load_profile(path).cpu_bandwidth == profile.cpu_bandwidth


def test_the_kernel_probe_recovers_the_timing_models_terms():
    """`kernel_terms` inverts the model a tier's call is timed by: call + E (phi + w / B +
    c q / F) for E experts on c rows, from the five calls `_kernel_fit` times."""
    from moespec.offload.sim.hardware import kernel_terms

    call, phi, bandwidth, flops, itemsize = 150e-6, 12e-6, 30e9, 40e9, 2
    w, w_small, many, rows = 12_582_912, 786_432, 8, 5

    def model(experts, c, nbytes):
        q = 2 * nbytes / itemsize
        return call + experts * (phi + nbytes / bandwidth + c * q / flops)

    times = {
        "one": model(1, 1, w), "row": model(many, 1, w), "rows": model(many, rows, w),
        "small_one": model(1, 1, w_small), "small_row": model(many, 1, w_small),
    }  # fmt: skip
    terms = kernel_terms(times, w, w_small, many, rows, itemsize)
    assert terms == pytest.approx(
        {"bandwidth": bandwidth, "expert_time": phi, "call_time": call, "flops": flops}
    )


def test_a_draft_that_stops_at_its_first_rejected_token_drafts_and_verifies_up_to_it():
    # As the rejected-drafts case above, with the confidence stop always taken: each step
    # drafts 1 token (0.1 ms), not 2, and verifies 2 tokens of expert 0 on the CPU (1 ms).
    trace = one_layer_trace([0] * 12)
    settings = dict(
        cache_ratio=0.0, draft_length=2, acceptance=0.0, tokens=5, draft_bytes_ratio=0.25,
        rejected_routing="continuation",
    )  # fmt: skip
    for stop, step_ms in ((0.0, 1.2), (1.0, 1.1)):
        result = simulate(
            trace, make_policy("lru"), ROUND, SimulationSettings(draft_stop=stop, **settings)
        )
        assert result.steps == result.tokens == 5
        assert result.seconds == pytest.approx(5 * step_ms * 1e-3)
        assert result.draft_seconds == pytest.approx(5 * (step_ms - 1.0) * 1e-3)


def test_the_draft_stop_shortens_drafts_only_after_a_rejection():
    # Accepted drafts 0, 3, 1, 2 of k = 3 (the last cut short by tokens = 9): the stop drafts
    # j + 1 tokens after j accepted ones (1, 3, 2, 3), never fewer than were accepted, and
    # emits what the full drafts emit.
    trace = one_layer_trace([0] * 40)
    given = (0, 3, 1, 2)
    base = dict(cache_ratio=1.0, draft_length=3, tokens=9, accepted=given, draft_bytes_ratio=0.25)
    full = simulate(trace, make_policy("lru"), ROUND, SimulationSettings(**base))
    stopped = simulate(trace, make_policy("lru"), ROUND, SimulationSettings(draft_stop=1.0, **base))
    draft_token = 0.1e-3  # 0.25 of 4 experts' 1 MB each, at the accelerator's 10 GB/s
    assert (full.steps, full.tokens) == (stopped.steps, stopped.tokens) == (4, 9)
    assert full.draft_seconds == pytest.approx(4 * 3 * draft_token)
    assert stopped.draft_seconds == pytest.approx((1 + 3 + 2 + 3) * draft_token)


def test_every_draft_stop_value_sees_the_same_steps():
    trace = one_layer_trace([0, 1, 2, 3] * 100)
    base = dict(cache_ratio=0.5, draft_length=4, acceptance=0.7, tokens=200, draft_bytes_ratio=0.25)
    runs = [
        simulate(trace, make_policy("lru"), ROUND, SimulationSettings(draft_stop=stop, **base))
        for stop in (0.0, 0.5, 1.0)
    ]
    assert len({(r.steps, r.tokens) for r in runs}) == 1
    drafts = [r.draft_seconds for r in runs]
    assert drafts[0] > drafts[1] > drafts[2] > 0
    with pytest.raises(ValueError, match="draft stop"):
        SimulationSettings(draft_stop=1.5)


def test_a_synthetic_workloads_fit_split_is_documents_of_its_own():
    from moespec.offload.sim.workload import synthetic_workload

    workload = synthetic_workload(
        "olmoe-1b-7b", tokens=60, fit_tokens=40, fit_documents=2, documents=3, seed=0
    )
    assert workload.trace.doc_starts.tolist() == [0, 20, 40, 60, 80, 100]
    assert workload.fit_trace().num_tokens == 40 == workload.fit_tokens
    assert workload.trace.metadata["local_popularity"] == 0.0
