"""Seed 000 §3.2-3.3 as properties: the speedup condition, the staircase and its step points."""

from fractions import Fraction

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from moespec.costmodel import (
    best_draft_length,
    convex_reaches,
    crossing_acceptance,
    expected_tokens,
    faster_than_plain,
    first_draft_threshold,
    speedup,
    step_points,
    step_points_convex,
    throughput,
)
from tests.strategies import acceptances, convex_step_tables, step_tables

F = Fraction


def tokens_per_time(step_times, a, k):
    """An oracle independent of the module's Horner sum: sum of powers a^i, i <= k, over V(k)."""
    return sum(a**i for i in range(k + 1)) / step_times[k]


def test_expected_tokens_is_the_geometric_sum_exactly():
    assert expected_tokens(F(1, 2), 0) == 1
    assert expected_tokens(F(1, 2), 2) == F(7, 4)
    assert expected_tokens(F(13, 20), 3) == (1 - F(13, 20) ** 4) / (1 - F(13, 20))
    assert isinstance(expected_tokens(F(1, 3), 4), Fraction)


def test_expected_tokens_matches_closed_form_on_floats():
    assert expected_tokens(0.7, 5) == pytest.approx((1 - 0.7**6) / 0.3, rel=1e-15)


@given(step_tables(), acceptances, st.data())
def test_speedup_condition_8_equals_direct_comparison(step_times, a, data):
    k = data.draw(st.integers(1, len(step_times) - 1))
    direct = tokens_per_time(step_times, a, k) > tokens_per_time(step_times, a, 0)
    assert faster_than_plain(step_times, a, k) == direct


@given(step_tables(), acceptances)
def test_first_draft_threshold_b4_decides_one_draft(step_times, a):
    a0 = first_draft_threshold(step_times)
    one_beats_none = tokens_per_time(step_times, a, 1) > tokens_per_time(step_times, a, 0)
    assert one_beats_none == (a > a0)


@given(step_tables(), acceptances)
def test_best_draft_length_is_the_smallest_maximiser(step_times, a):
    best = best_draft_length(step_times, a)
    values = [tokens_per_time(step_times, a, k) for k in range(len(step_times))]
    assert values[best] == max(values)
    assert all(values[k] < values[best] for k in range(best))


@given(step_tables(), acceptances, acceptances)
def test_best_draft_length_never_falls_as_acceptance_rises_b28(step_times, a, b):
    low, high = sorted((a, b))
    assert best_draft_length(step_times, low) <= best_draft_length(step_times, high)


@given(step_tables(), acceptances)
def test_step_points_b31_decide_the_staircase(step_times, a):
    points = step_points(step_times)
    best = best_draft_length(step_times, a)
    for j, a_j in enumerate(points, start=1):
        # (B.31) says nothing at a = a_j itself; a_j is known to 2^-44 unless rational.
        assume(abs(a - a_j) > 1e-11)
        assert (best >= j) == (a > a_j)


@given(step_tables())
def test_step_points_are_non_decreasing_and_in_unit_interval(step_times):
    points = step_points(step_times)
    assert all(0 <= p <= 1 for p in points)
    assert all(points[i] <= points[i + 1] for i in range(len(points) - 1))


@given(step_tables(min_size=3), st.data())
def test_crossing_acceptance_is_where_k_starts_beating_i(step_times, data):
    k = data.draw(st.integers(1, len(step_times) - 1))
    i = data.draw(st.integers(0, k - 1))
    alpha = crossing_acceptance(step_times, k, i)
    a = data.draw(acceptances)
    assume(abs(a - alpha) > 1e-11)
    beats = tokens_per_time(step_times, a, k) > tokens_per_time(step_times, a, i)
    assert beats == (a > alpha)


@given(convex_step_tables(), acceptances)
def test_convex_closed_test_10_decides_every_step(step_times, a):
    best = best_draft_length(step_times, a)
    for j in range(1, len(step_times)):
        assert convex_reaches(step_times, a, j) == (best >= j)


@given(convex_step_tables())
def test_convex_step_points_b36_equal_the_general_ones(step_times):
    general, convex = step_points(step_times), step_points_convex(step_times)
    assert all(abs(g - c) <= 1e-12 for g, c in zip(general, convex, strict=True))
    c1 = step_times[1] - step_times[0]
    assert convex[0] == min(c1 / step_times[0], 1)  # a_1 exactly


def test_step_points_are_exact_when_rational():
    # Affine V: a_1 = c_1 / V(0) = 3/10 exactly, found by bisection then recognised.
    assert step_points([F(1), F(13, 10), F(16, 10)])[0] == F(3, 10)


def test_float_step_points_within_1e_12():
    points = step_points([1.0, 1.3, 1.6])
    assert abs(points[0] - 0.3) <= 1e-12


@given(step_tables(), acceptances, st.data())
def test_speedup_9_is_throughput_ratio(step_times, a, data):
    k = data.draw(st.integers(0, len(step_times) - 1))
    assert speedup(step_times, a, k) == tokens_per_time(step_times, a, k) / tokens_per_time(
        step_times, a, 0
    )


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: expected_tokens(1, 2), "acceptance must be in [0, 1)"),
        (lambda: expected_tokens(-0.1, 2), "acceptance must be in [0, 1)"),
        (lambda: expected_tokens(0.5, -1), "draft_length must be a non-negative integer"),
        (lambda: best_draft_length([], 0.5), "step_times needs at least 1"),
        (lambda: best_draft_length([1, 0, 2], 0.5), "step_times[1] must be positive"),
        (lambda: best_draft_length([1, -2], 0.5), "step_times[1] must be positive"),
        (lambda: throughput([1, 2], 0.5, 2), "draft_length must be in 0..1"),
        (lambda: step_points([1]), "at least 2"),
        (lambda: first_draft_threshold([1]), "at least 2"),
        (lambda: convex_reaches([1, 3, 4], 0.5, 1), "non-decreasing"),
        (lambda: best_draft_length([1, 2], float("nan")), "NaN"),
    ],
)
def test_bad_inputs_raise_value_error_naming_the_argument(call, message):
    with pytest.raises(ValueError, match=_escape(message)):
        call()


def _escape(text: str) -> str:
    import re

    return re.escape(text)
