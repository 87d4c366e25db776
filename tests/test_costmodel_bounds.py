"""Seed 000 Table 2 and (C.7) as properties: each bound holds under random bandwidth errors."""

from fractions import Fraction

from hypothesis import given
from hypothesis import strategies as st

from moespec.costmodel import (
    best_draft_length,
    best_draft_length_is_certain,
    kernel_choice_is_robust,
    saving_bound,
    speedup,
    speedup_bounds,
    speedup_error_factor,
    step_time_error,
    throughput,
    throughput_loss_bound,
    verify_time,
    verify_time_bound,
)
from tests.strategies import acceptances, non_negative, positive, step_tables

F = Fraction
errors = st.fractions(min_value=0, max_value=F(49, 100), max_denominator=101)


@st.composite
def perturbations(draw, epsilon):
    """A relative bandwidth error e with |e| <= epsilon."""
    return draw(st.fractions(min_value=-epsilon, max_value=epsilon, max_denominator=1009))


@given(positive, positive, non_negative, positive, non_negative, non_negative, errors, st.data())
def test_verify_time_bound_17(expert, bandwidth, dense, dense_bw, t0, fixed, epsilon, data):
    e1, e2 = data.draw(perturbations(epsilon)), data.draw(perturbations(epsilon))
    kwargs = {"pass_dense_bytes": dense, "outside_time": t0, "fixed_work": fixed}
    true = verify_time(expert, bandwidth, dense_bandwidth=dense_bw, **kwargs)
    estimate = verify_time(
        expert, bandwidth * (1 + e2), dense_bandwidth=dense_bw * (1 + e1), **kwargs
    )
    memory = dense / dense_bw + expert / bandwidth
    assert abs(estimate - true) <= verify_time_bound(memory, epsilon)
    assert verify_time_bound(memory, epsilon) <= epsilon / (1 - epsilon) * true


@given(positive, positive, positive, positive, non_negative, positive, errors, st.data())
def test_saving_bound_18(e_slot, b_slot, e_dedup, b_dedup, dense, dense_bw, epsilon, data):
    e_dense, e1, e2 = (data.draw(perturbations(epsilon)) for _ in range(3))

    def saving(slot_bw, dedup_bw, dense_bandwidth):
        common = {"pass_dense_bytes": dense, "dense_bandwidth": dense_bandwidth}
        return verify_time(e_slot, slot_bw, **common) - verify_time(e_dedup, dedup_bw, **common)

    true = saving(b_slot, b_dedup, dense_bw)
    estimate = saving(b_slot * (1 + e1), b_dedup * (1 + e2), dense_bw * (1 + e_dense))
    assert abs(estimate - true) <= saving_bound(e_slot / b_slot, e_dedup / b_dedup, epsilon)


@given(
    positive,
    positive,
    st.fractions(min_value=F(1, 100), max_value=1, max_denominator=101),
    st.fractions(min_value=F(1, 10), max_value=2, max_denominator=101),
    errors,
    st.data(),
)
def test_kernel_choice_margin_19_keeps_the_sign_of_the_saving(
    e_slot, b_slot, share, ratio, epsilon, data
):
    e1, e2 = data.draw(perturbations(epsilon)), data.draw(perturbations(epsilon))

    def saving(slot_bw, dedup_bw):
        return e_slot / slot_bw - share * e_slot / dedup_bw

    true = saving(b_slot, ratio * b_slot)
    estimate = saving(b_slot * (1 + e1), ratio * b_slot * (1 + e2))
    if kernel_choice_is_robust(share, ratio, epsilon):
        assert (estimate > 0) == (true > 0)


@given(step_tables(), acceptances, errors, st.data())
def test_throughput_loss_bound_and_separation_20(step_times, a, delta, data):
    noise = data.draw(
        st.lists(perturbations(delta), min_size=len(step_times), max_size=len(step_times))
    )
    predicted = [v * (1 + d) for v, d in zip(step_times, noise, strict=True)]
    k_true, k_hat = best_draft_length(step_times, a), best_draft_length(predicted, a)
    best = throughput(step_times, a, k_true)
    assert throughput(step_times, a, k_hat) >= (1 - throughput_loss_bound(delta)) * best
    if best_draft_length_is_certain(step_times, a, delta):
        assert k_hat == k_true
    if best_draft_length_is_certain(predicted, a, delta):
        assert k_hat == k_true


@given(step_tables(), acceptances, errors, st.data())
def test_best_speedup_bounds_21(step_times, a, delta, data):
    noise = data.draw(
        st.lists(perturbations(delta), min_size=len(step_times), max_size=len(step_times))
    )
    predicted = [v * (1 + d) for v, d in zip(step_times, noise, strict=True)]
    true = speedup(step_times, a, best_draft_length(step_times, a))
    estimate = speedup(predicted, a, best_draft_length(predicted, a))
    low, high = speedup_bounds(delta)
    assert low * true <= estimate <= high * true


@given(
    st.lists(st.tuples(positive, positive), min_size=1, max_size=5), non_negative, errors, st.data()
)
def test_step_time_error_c7_bounds_bandwidth_only_errors(terms, t0, epsilon, data):
    # A step time of several memory terms bytes/bandwidth plus exact time; perturb each bandwidth.
    true = t0 + sum(b / bw for b, bw in terms)
    estimate = t0 + sum(b / (bw * (1 + data.draw(perturbations(epsilon)))) for b, bw in terms)
    delta = step_time_error(epsilon)
    assert (1 - delta) * true <= estimate <= (1 + delta) * true


def test_ten_percent_bandwidth_error_moves_speedup_by_at_most_25_percent_c7():
    assert step_time_error(F(1, 10)) == F(1, 9)
    assert speedup_error_factor(F(1, 10)) == F(5, 4)
    assert speedup_bounds(step_time_error(F(1, 10)))[1] == F(5, 4)


# Exact values and the worst case e = -epsilon: each bound is the formula of Table 2 and is
# reached (or, for (18), exceeds the worst corner), so a bound made too small fails here.


def test_verify_time_bound_17_is_reached_at_e_minus_epsilon():
    expert, bandwidth, dense, dense_bw, epsilon = F(6), F(3), F(2), F(4), F(1, 10)
    true = verify_time(expert, bandwidth, pass_dense_bytes=dense, dense_bandwidth=dense_bw)
    worst = verify_time(
        expert,
        bandwidth * (1 - epsilon),
        pass_dense_bytes=dense,
        dense_bandwidth=dense_bw * (1 - epsilon),
    )
    memory = dense / dense_bw + expert / bandwidth  # 5/2
    assert verify_time_bound(memory, epsilon) == F(1, 9) * F(5, 2)
    assert worst - true == verify_time_bound(memory, epsilon)


def test_saving_bound_18_covers_the_worst_corner_of_both_kernels():
    slot_time, dedup_time, epsilon = F(3), F(2), F(1, 5)
    assert saving_bound(slot_time, dedup_time, epsilon) == F(1, 4) * 5
    # The saving moves most when the two kernels' errors pull apart: slot at -eps, dedup +eps.
    moved = slot_time / (1 - epsilon) - slot_time - (dedup_time / (1 + epsilon) - dedup_time)
    assert moved == F(3, 4) + F(1, 3)
    assert moved <= saving_bound(slot_time, dedup_time, epsilon)
    assert moved > epsilon / (1 - epsilon) * slot_time  # a bound of one kernel's term is short


def test_loss_and_speedup_bounds_20_21_are_their_formulas():
    delta = F(1, 10)
    assert throughput_loss_bound(delta) == F(2, 11)
    assert speedup_bounds(delta) == (F(9, 11), F(11, 9))


def test_step_time_error_c7_is_reached_at_e_minus_epsilon():
    epsilon = F(1, 10)
    terms = [(F(3), F(2)), (F(5), F(7))]
    true = sum(b / bw for b, bw in terms)
    worst = sum(b / (bw * (1 - epsilon)) for b, bw in terms)
    assert worst == (1 + step_time_error(epsilon)) * true
