"""Synthetic routing: the locality process, its fit to a target rho(2), and the model shapes."""

import numpy as np
import pytest

from moespec.routing.reuse import document_statistics, estimate
from moespec.routing.shapes import SHAPES, get_shape
from moespec.routing.synthetic import (
    LocalityProcess,
    document_lengths,
    synthetic_trace,
    uniform_process,
)


def closed_form_reuse2(num_experts, top_k, p):
    """Flat popularity: k ~ Binomial(m, p) experts kept; the m - k fresh ones are uniform over
    the N - k not kept, of which m - k were the previous token's: E|S_t ∩ S_t-1| / m."""
    from math import comb

    total = 0.0
    for k in range(top_k + 1):
        chance = comb(top_k, k) * p**k * (1 - p) ** (top_k - k)
        total += chance * (k + (top_k - k) ** 2 / (num_experts - k))
    return total / top_k


@pytest.mark.parametrize("p", [0.0, 0.3, 0.7])
def test_simulated_reuse2_matches_the_closed_form_under_flat_popularity(p):
    process = LocalityProcess(16, 4, popularity_skew=0.0)
    # 50k consecutive pairs: a standard error below 0.003 even with the chain's correlation
    simulated = process.simulated_reuse2(p, tokens=50_000, seed=1)
    assert simulated == pytest.approx(closed_form_reuse2(16, 4, p), abs=0.01)


@pytest.mark.parametrize("name", [n for n, s in SHAPES.items() if s.published_reuse2])
def test_fitted_process_reproduces_the_published_reuse2_within_0_02(name):
    shape = get_shape(name)
    process = LocalityProcess(shape.num_experts, shape.top_k).fit(
        shape.published_reuse2, tokens=20_000
    )
    assert 0 < process.keep_probability_ < 1
    trace = synthetic_trace(
        process, num_layers=3, tokens=12_000, documents=12, expert_bytes=shape.expert_bytes[:3]
    )
    measured = estimate(document_statistics(trace, 2), bootstrap=0).reuse_mean[1]
    assert measured == pytest.approx(shape.published_reuse2, abs=0.02)


def test_a_target_below_what_popularity_alone_gives_is_refused():
    process = LocalityProcess(16, 4, popularity_skew=2.0)
    with pytest.raises(ValueError, match="below .* what expert popularity alone gives"):
        process.fit(0.26, tokens=5_000)
    with pytest.raises(ValueError, match=r"must be in \(0, 1\)"):
        process.fit(1.0)


def test_more_skew_means_more_reuse_without_any_locality():
    flat = LocalityProcess(32, 4, popularity_skew=0.0).simulated_reuse2(0.0, tokens=20_000)
    skewed = LocalityProcess(32, 4, popularity_skew=1.0).simulated_reuse2(0.0, tokens=20_000)
    assert flat == pytest.approx(4 / 32, abs=0.01)
    assert skewed > flat + 0.05


def test_documents_start_in_the_stationary_law():
    # Strong locality and skew: a chain started from a popularity draw would over-select the
    # favourite expert for tens of tokens (0.90 of tokens against 0.85 here). After the burn-in,
    # each document's first token selects it as often as its last does.
    documents, length = 8000, 40
    process = LocalityProcess(8, 2, keep_probability=0.95, popularity_skew=2.0)
    trace = synthetic_trace(process, num_layers=1, tokens=documents * length, documents=documents)
    ids = trace.expert_ids[:, 0].reshape(documents, length, 2)  # [D, T_d, m]
    favourite = np.bincount(ids.ravel()).argmax()
    first = (ids[:, 0] == favourite).any(-1).mean()
    last = (ids[:, -1] == favourite).any(-1).mean()
    se = np.sqrt(2 * first * (1 - first) / documents)  # of the difference, if independent
    assert abs(first - last) <= 4 * se


def test_every_token_selects_m_distinct_experts_in_range():
    trace = synthetic_trace(
        LocalityProcess(130, 6, keep_probability=0.5), num_layers=2, tokens=500, documents=3
    )
    ids = trace.expert_ids
    assert ids.shape == (500, 2, 6) and ids.min() >= 0 and ids.max() < 130
    assert np.all(np.diff(np.sort(ids, axis=-1), axis=-1) > 0)


def test_the_same_seed_gives_the_same_trace_and_another_seed_another():
    process = uniform_process(8, 2)
    first = synthetic_trace(process, num_layers=2, tokens=300, documents=3, seed=5)
    again = synthetic_trace(process, num_layers=2, tokens=300, documents=3, seed=5)
    other = synthetic_trace(process, num_layers=2, tokens=300, documents=3, seed=6)
    np.testing.assert_array_equal(first.expert_ids, again.expert_ids)
    assert not np.array_equal(first.expert_ids, other.expert_ids)
    assert first.doc_names == ["synthetic-0", "synthetic-1", "synthetic-2"]


def test_document_lengths_split_the_tokens_evenly():
    assert document_lengths(10, 3) == [4, 3, 3]
    assert document_lengths(5, 5) == [1] * 5
    with pytest.raises(ValueError, match="documents <= tokens"):
        document_lengths(3, 4)


def test_shapes_give_the_bf16_bytes_of_a_swiglu_expert():
    assert get_shape("qwen3-30b-a3b").bytes_per_expert == 3 * 2048 * 768 * 2
    assert get_shape("olmoe-1b-7b").bytes_per_expert == 3 * 2048 * 1024 * 2
    assert get_shape("gpt-oss-20b").bytes_per_expert == 3 * 2880 * 2880 * 2
    deepseek = get_shape("deepseek-v2-lite")
    assert deepseek.bytes_per_expert == 3 * 2048 * 1408 * 2
    assert deepseek.shared_expert_bytes == 2 * deepseek.bytes_per_expert


def test_dense_layers_mlps_are_dense_bytes_of_the_shape():
    # DeepSeek-V2-Lite and GLM-4.5-Air: one dense first layer of intermediate size 10944.
    assert get_shape("deepseek-v2-lite").dense_mlp_bytes == 3 * 2048 * 10944 * 2
    assert get_shape("glm-4.5-air").dense_mlp_bytes == 3 * 4096 * 10944 * 2
    assert get_shape("qwen3-30b-a3b").dense_mlp_bytes == 0  # every layer is MoE


@pytest.mark.parametrize(
    "name, layers, first_layer, experts, top_k",
    [
        ("qwen3-30b-a3b", 48, 0, 128, 8),
        ("deepseek-v2-lite", 26, 1, 64, 6),  # its first decoder layer is dense
        ("olmoe-1b-7b", 16, 0, 64, 8),
        ("gpt-oss-20b", 24, 0, 32, 4),
        ("glm-4.5-air", 45, 1, 128, 8),
    ],
)
def test_shapes_give_the_routing_dimensions(name, layers, first_layer, experts, top_k):
    shape = get_shape(name)
    assert (shape.num_layers, shape.num_experts, shape.top_k) == (layers, experts, top_k)
    assert shape.layer_indices[0] == first_layer and len(shape.expert_bytes) == layers


def test_an_unknown_shape_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown model shape 'gpt-5'.*qwen3-30b-a3b"):
        get_shape("gpt-5")


def test_simulated_reuse_starts_at_rho2_and_rises_with_n():
    process = LocalityProcess(32, 4, keep_probability=0.3, popularity_skew=0.8)
    reuse = process.simulated_reuse(0.3, 6, tokens=20_000)
    assert reuse[0] == pytest.approx(process.simulated_reuse2(0.3, tokens=20_000), abs=0.01)
    assert all(b >= a for a, b in zip(reuse, reuse[1:], strict=False))


def test_qwen3_shape_skew_reproduces_the_published_rho9():
    from moespec.routing.shapes import get_shape

    shape = get_shape("qwen3-30b-a3b")
    process = LocalityProcess(shape.num_experts, shape.top_k, popularity_skew=shape.popularity_skew)
    process.fit(shape.published_reuse2, tokens=30_000)
    reuse = process.simulated_reuse(process.p, 9, tokens=30_000)
    assert reuse[0] == pytest.approx(shape.published_reuse2, abs=0.01)
    assert reuse[-1] == pytest.approx(shape.published_reuse9, abs=0.01)


def test_local_popularity_keeps_windows_and_loses_what_other_documents_predict():
    """beta = 0: one popularity for every document, so the fit documents' hottest quarter
    covers far more of the others' activations than a quarter; beta = 1: each document's own
    order, so it covers about a quarter (what any quarter of the experts gets on average).
    At the same skew and keep probability a document's windows are alike either way: both
    mix Zipf laws of the same exponent, and a pure one (beta 0 or 1) has the same rho(2)."""
    from moespec.routing.reuse import static_coverage

    lengths = [200] * 40
    coverage, reuse2 = {}, {}
    for beta in (0.0, 1.0):
        process = LocalityProcess(32, 4, keep_probability=0.3, popularity_skew=1.2,
                                  local_popularity=beta)  # fmt: skip
        trace = synthetic_trace(process, num_layers=2, lengths=lengths, seed=3)
        assert trace.doc_starts.tolist() == list(range(0, 8001, 200))
        coverage[beta] = static_coverage(trace, 2000)
        reuse2[beta] = process.simulated_reuse2(0.3, tokens=40_000)
    assert coverage[0.0] > 0.6 and 0.2 < coverage[1.0] < 0.32
    assert reuse2[0.0] == pytest.approx(reuse2[1.0], abs=0.01)
    with pytest.raises(ValueError, match="local_popularity"):
        LocalityProcess(8, 2, local_popularity=1.5)


def test_no_local_popularity_draws_nothing_more():
    """beta = 0 leaves the generator's stream as it was: the same trace as before the option."""
    a = synthetic_trace(LocalityProcess(16, 2, keep_probability=0.4), num_layers=3,
                        tokens=300, documents=3, seed=7)  # fmt: skip
    b = synthetic_trace(
        LocalityProcess(16, 2, keep_probability=0.4, local_popularity=0.0),
        num_layers=3,
        lengths=[100, 100, 100],
        seed=7,
    )
    np.testing.assert_array_equal(a.expert_ids, b.expert_ids)
