"""The reuse estimator of seed 000 App. D.2 on hand-made traces, against the definitions (1)-(2),
uniform routing, random pairing; its bootstrap; and the fit/test split of documents."""

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moespec.costmodel import best_draft_length, byte_share, mean_reuse, union_from_reuse
from moespec.routing.reuse import (
    check_not_degenerate,
    document_part,
    document_statistics,
    estimate,
    reuse_report,
    split_trace,
    uniform_curves,
    weighted_estimates,
)
from moespec.routing.synthetic import LocalityProcess, synthetic_trace, uniform_process
from tests.routing_traces import brute_force, make_trace

F = Fraction


def point(trace, max_n=3):
    return estimate(document_statistics(trace, max_n), bootstrap=0)


def exact(values):
    return [F(float(v)).limit_denominator(1000) for v in values]


def test_one_document_of_pattern_00012_gives_hand_counted_values():
    # 00012 00012 00012: windows of 2 start at t = 0..13 and repeat an expert when they read
    # "00" (t = 0, 1, 5, 6, 10, 11): 6 of 14. Windows of 3 start at t = 0..12 and the last
    # token repeats at "000" (t = 0, 5, 10) and "200" (t = 4, 9): 5 of 13. Pairs name one
    # expert 6 times and two experts 8 times: U(2) = 22/14.
    result = point(make_trace({"d": [0, 0, 0, 1, 2] * 3}, num_experts=3))
    assert exact(result.reuse[0]) == [0, F(3, 7), F(5, 13)]
    assert exact(result.union[0][:2]) == [1, F(11, 7)]


def test_one_document_of_pattern_00102_gives_hand_counted_values():
    # 00102 00102 00102: pairs repeat only at "00" (t = 0, 5, 10): 3 of 14. Triples repeat
    # at "010" (t = 1, 6, 11), "020" (t = 3, 8) and "200" (t = 4, 9): 7 of 13.
    result = point(make_trace({"d": [0, 0, 1, 0, 2] * 3}, num_experts=3))
    assert exact(result.reuse[0]) == [0, F(3, 14), F(7, 13)]


@pytest.mark.parametrize(
    "pattern, reuse_bar, best_length",
    [
        ("01", [0, F(1, 2)], 2),
        ("00012", [F(2, 5), F(2, 5)], 1),
        ("00102", [F(1, 5), F(2, 5)], 0),
    ],
)
def test_every_phase_of_a_periodic_pattern_gives_the_app_b2_table(pattern, reuse_bar, best_length):
    # One document per phase: each phase starts equally many windows of every n, so the
    # estimate is the reuse of the pattern started at a uniformly random phase (App. B.2).
    period = [int(c) for c in pattern]
    documents = {f"phase{s}": (period[s:] + period * 3)[:3] for s in range(len(period))}
    result = point(make_trace(documents, num_experts=3))
    reuse = exact(result.reuse[0])
    assert [mean_reuse([reuse], [1], k) for k in (1, 2)] == reuse_bar
    # N = 3, m = 1, w = 1, D = 0, kv = 0, a = 13/20: V(k) = U(k + 1) in bytes.
    step_times = union_from_reuse(reuse, 1)
    assert exact(result.union[0]) == step_times
    assert best_draft_length(step_times, F(13, 20)) == best_length


def test_alternating_two_experts_give_union_1_2_2_and_a_staircase_jump():
    # App. B.3: N = 2, m = 1, tokens alternate with a random phase: V_dedup = (1, 2, 2).
    result = point(make_trace({"a": [0, 1, 0], "b": [1, 0, 1]}, num_experts=2))
    step_times = exact(result.union[0])
    assert step_times == [1, 2, 2]
    assert exact(result.reuse[0]) == [0, 0, 1]
    assert best_draft_length(step_times, F(1, 2)) == 0
    assert best_draft_length(step_times, F(9, 10)) == 2


@st.composite
def small_traces(draw):
    experts = draw(st.sampled_from([2, 5, 16, 64, 65, 130]))  # 65, 130: several bitmask words
    top_k = draw(st.integers(1, min(4, experts - 1)))
    layers = draw(st.integers(1, 2))
    lengths = draw(st.lists(st.integers(1, 8), min_size=1, max_size=3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    # a few favourite experts per layer, so that windows repeat experts often
    pool = max(top_k, draw(st.integers(top_k, experts)))
    documents = {
        f"d{i}": [
            [rng.choice(pool, top_k, replace=False) for _ in range(layers)] for _ in range(length)
        ]
        for i, length in enumerate(lengths)
    }
    return make_trace(documents, num_experts=experts)


@settings(max_examples=40, deadline=None)
@given(trace=small_traces(), max_n=st.integers(1, 6))
def test_estimates_equal_the_definitions_window_by_window(trace, max_n):
    result = point(trace, max_n)
    reuse, union = brute_force(trace, max_n)
    np.testing.assert_allclose(result.reuse, reuse, equal_nan=True)
    np.testing.assert_allclose(result.union, union, equal_nan=True)


def test_windows_never_cross_documents_and_longer_windows_than_any_document_are_nan():
    trace = make_trace({"short": [0, 1], "long": [1, 0, 1, 0, 1]}, num_experts=2)
    result = point(trace, max_n=6)
    assert result.windows.tolist() == [7, 5, 3, 2, 1, 0]
    assert np.isnan(result.reuse[0, 5]) and np.isnan(result.byte_share[5])
    # "short" ends in 1 and "long" starts with 1, yet no pair spans the boundary
    assert result.reuse[0, 1] == 0


def test_a_token_naming_an_expert_twice_is_refused():
    trace = make_trace({"d": [[[0, 1]], [[2, 2]]]}, num_experts=3)
    with pytest.raises(ValueError, match="same expert twice"):
        document_statistics(trace)


def test_byte_share_and_distinct_share_follow_the_cost_model():
    rng = np.random.default_rng(3)
    documents = {"d": [[rng.choice(6, 2, replace=False) for _ in range(2)] for _ in range(9)]}
    trace = make_trace(documents, num_experts=6, expert_bytes=[1, 3])
    result = point(trace, max_n=4)
    for n in range(1, 5):
        unions = [F(float(u)).limit_denominator(10**6) for u in result.union[:, n - 1]]
        assert result.byte_share[n - 1] == pytest.approx(float(byte_share(unions, [1, 3], 2, n)))
        assert result.distinct_share[:, n - 1] == pytest.approx(result.union[:, n - 1] / (2 * n))


def test_a_bootstrap_resample_is_the_estimate_on_the_resampled_documents():
    rng = np.random.default_rng(5)
    documents = {
        f"d{i}": [[rng.choice(8, 2, replace=False)] for _ in range(rng.integers(2, 9))]
        for i in range(4)
    }
    trace = make_trace(documents, num_experts=8)
    counts = np.array([2, 0, 1, 1])  # d0 twice, d1 never
    resampled = trace.select_documents(["d0", "d0", "d2", "d3"])
    weighted = weighted_estimates(document_statistics(trace, 4), counts[None].astype(float))
    direct = point(resampled, 4)
    for name in ("reuse", "union", "byte_share", "reuse_mean"):
        np.testing.assert_allclose(weighted[name][0], getattr(direct, name))


def test_bootstrap_intervals_depend_only_on_the_seed():
    trace = synthetic_trace(
        LocalityProcess(8, 2, keep_probability=0.5), num_layers=1, tokens=600, documents=12
    )
    stats = document_statistics(trace, 4)
    first = estimate(stats, bootstrap=200, seed=1)
    again = estimate(stats, bootstrap=200, seed=1)
    other = estimate(stats, bootstrap=200, seed=2)
    np.testing.assert_array_equal(first.intervals["reuse"], again.intervals["reuse"])
    assert not np.array_equal(first.intervals["reuse"], other.intervals["reuse"])
    low, high = first.intervals["reuse_mean"][:, 1]
    assert low < first.reuse_mean[1] < high


def standard_error(result, name):
    # Documents are independent draws, so the bootstrap over documents estimates the standard
    # error; a 95% percentile interval spans about 2 x 1.96 of them.
    low, high = result.intervals[name]
    return (high - low) / (2 * 1.96)


def test_independent_uniform_routing_matches_1_minus_q_and_N_1_minus_q_n():
    trace = synthetic_trace(
        uniform_process(16, 2), num_layers=2, tokens=40_000, documents=200, seed=11
    )
    result = estimate(document_statistics(trace, 6), bootstrap=300, seed=0)
    curves = uniform_curves(16, 2, 6)
    assert result.reuse_mean[0] == 0 and result.union_mean[0] == 2
    for name, curve in (("reuse_mean", curves["reuse"]), ("union_mean", curves["union"])):
        se = standard_error(result, name)[1:]
        assert np.all(se < 0.01 * np.asarray(curve[1:]))  # the check has power
        # five standard errors: a false alarm has probability below 1e-6 per point
        assert np.all(np.abs(getattr(result, name)[1:] - curve[1:]) <= 5 * se)


def test_identity_2_union_equals_m_sum_of_one_minus_reuse_on_a_stationary_process():
    process = LocalityProcess(16, 2, keep_probability=0.6, popularity_skew=0.7)
    trace = synthetic_trace(process, num_layers=2, tokens=40_000, documents=200, seed=4)
    result = estimate(document_statistics(trace, 8), bootstrap=300, seed=0)
    se = standard_error(result, "union")  # [L, n_max]
    for layer in range(2):
        implied = union_from_reuse([float(r) for r in result.reuse[layer]], 2)
        assert np.all(np.abs(result.union[layer] - implied) <= 5 * se[layer] + 1e-12)
    assert result.reuse_mean[1] > 0.5  # the process has locality to speak of


def test_random_pairing_removes_temporal_locality():
    process = LocalityProcess(32, 4, keep_probability=0.8, popularity_skew=0.0)
    trace = synthetic_trace(process, num_layers=2, tokens=8000, documents=20)
    report = reuse_report(trace, max_n=4, bootstrap=100)
    shuffled, measured = report.random_pairing.reuse_mean[1], report.measured.reuse_mean[1]
    assert measured > 0.8
    assert shuffled < measured - 0.5
    assert shuffled == pytest.approx(report.uniform["reuse"][1], abs=0.03)  # flat popularity


def test_random_pairing_keeps_expert_popularity():
    # Without locality, shuffling changes nothing: reuse above uniform is popularity alone.
    process = LocalityProcess(32, 4, keep_probability=0.0, popularity_skew=1.2)
    trace = synthetic_trace(process, num_layers=2, tokens=20_000, documents=50)
    report = reuse_report(trace, max_n=3, bootstrap=200)
    measured, shuffled = report.measured, report.random_pairing
    se = standard_error(measured, "reuse_mean")[1]
    assert abs(shuffled.reuse_mean[1] - measured.reuse_mean[1]) <= 5 * np.sqrt(2) * se
    assert shuffled.reuse_mean[1] > report.uniform["reuse"][1] + 0.1


def test_split_is_a_fixed_function_of_each_name():
    names = [f"doc-{i}" for i in range(10)]
    # pinned: the same on every run and machine (SHA-256 of the name)
    assert [document_part(n) for n in names] == [
        "test",
        "test",
        "fit",
        "test",
        "test",
        "test",
        "fit",
        "fit",
        "fit",
        "test",
    ]
    assert {document_part(n, 0.0) for n in names} == {"test"}
    assert {document_part(n, 1.0) for n in names} == {"fit"}


def test_split_does_not_depend_on_the_other_documents_and_halves_a_large_corpus():
    trace = make_trace({f"doc-{i}": [i % 3, (i + 1) % 3] for i in range(400)}, num_experts=3)
    fit = split_trace(trace, "fit")
    test = split_trace(trace, "test")
    assert sorted(fit.doc_names + test.doc_names) == sorted(trace.doc_names)
    assert 150 < fit.num_documents < 250
    subset = trace.select_documents(trace.doc_names[:50])
    assert split_trace(subset, "fit").doc_names == [
        n for n in fit.doc_names if n in subset.doc_names
    ]
    assert split_trace(trace, "all") is trace


def test_an_empty_part_is_refused():
    trace = make_trace({"doc-0": [0, 1]}, num_experts=2)
    with pytest.raises(ValueError, match="no document of the trace falls in the fit part"):
        split_trace(trace, "fit")


def test_a_trace_of_one_repeated_token_is_refused_as_degenerate():
    # What a word-level tokenizer that maps every word to one id records: the same two experts
    # in every layer for every token.
    one_token = [[[3, 5], [1, 2]]] * 40
    with pytest.raises(ValueError, match="degenerate.*real tokenizer"):
        check_not_degenerate(make_trace({"a": one_token, "b": one_token}, 8), "model-x")


def test_a_trace_whose_experts_vary_passes_the_degeneracy_check():
    varied = [[[t % 8, (t + 1) % 8]] for t in range(40)]
    check_not_degenerate(make_trace({"a": varied}, 8), "model-x")
    # A document boundary is not a pair: two documents, each one repeated set, differ.
    same = [[[1, 2]]] * 20
    other = [[[3, 4]]] * 20
    with pytest.raises(ValueError, match="rho\\(2\\) = 1.000"):
        check_not_degenerate(make_trace({"a": same, "b": other}, 8), "model-x")


def test_demo_text_through_the_benchmark_tokenizer_is_not_degenerate(tmp_path):
    # Benchmark checkpoints of real shapes carry the demo's byte-level BPE: held-out text
    # becomes varied ids and routes as text does.

    import torch
    import transformers

    from moespec.bench.checkpoints import has_text_tokenizer, write_text_tokenizer
    from moespec.demo.corpus import held_out_documents
    from moespec.models import load_model
    from moespec.routing.record import record_trace
    from tests.checkpoints import FAMILIES

    settings = dict(FAMILIES["olmoe"], vocab_size=4096, num_hidden_layers=1)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model("olmoe", **settings)
    )
    model.save_pretrained(tmp_path)
    assert not has_text_tokenizer(tmp_path)
    write_text_tokenizer(tmp_path)
    assert has_text_tokenizer(tmp_path)
    engine, tokenizer = load_model(tmp_path, dtype="fp32")
    trace = record_trace(engine, tokenizer, held_out_documents(2, 2000), truncate="right")
    assert len(np.unique(trace.expert_ids[:, 0], axis=0)) > 4
    check_not_degenerate(trace, str(tmp_path))


def test_static_coverage_counts_the_fit_parts_hottest_quarter():
    """Layer 0: experts 0 and 1 are the fit part's hottest (ceil(0.25 x 8) = 2 of 8); of the
    rest's 8 activations, 3 go to them. Layer 1: the hottest are 6 and 7, which take all 8.
    Mean (3/8 + 1) / 2."""
    from moespec.routing import RoutingTrace
    from moespec.routing.reuse import static_coverage

    fit = [[[0, 1], [6, 7]], [[0, 2], [6, 7]], [[1, 3], [7, 6]]]
    rest = [[[0, 4], [6, 7]], [[5, 1], [7, 6]], [[4, 5], [6, 7]], [[0, 3], [7, 6]]]
    ids = np.array(fit + rest)  # [7, 2, 2]
    trace = RoutingTrace(ids, [0, 7], ["d"], 8, [1, 1], [0, 1])
    assert static_coverage(trace, 3) == pytest.approx((3 / 8 + 1) / 2)
    with pytest.raises(ValueError, match="fit_tokens"):
        static_coverage(trace, 7)
