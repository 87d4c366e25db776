"""Error bounds of seed 000 Table 2, eqs. (17)-(21), and delta from epsilon (C.7).

A measured bandwidth beta is estimated as beta (1 + e) with |e| <= epsilon < 1 (the bandwidth
error, `bandwidth_error`); a predicted step time lies within (1 +- delta) of the true one
(the step-time error, `step_time_error`). Exact on `fractions.Fraction` inputs: no logarithms.
"""

from collections.abc import Sequence

from moespec.costmodel._checks import (
    Number,
    check_acceptance,
    check_bandwidth_error,
    check_non_negative,
    check_positive,
    check_step_times,
)
from moespec.costmodel.speculation import _best_draft_length, _throughput


def verify_time_bound(memory_time: Number, bandwidth_error: Number) -> Number:
    """(17): |tau_hat_p(n) - tau_p(n)| <= eps/(1-eps) M_p(n), M_p(n) the memory part of tau_p(n)."""
    memory_time = check_non_negative(memory_time, "memory_time")
    bandwidth_error = check_bandwidth_error(bandwidth_error)
    return bandwidth_error / (1 - bandwidth_error) * memory_time


def saving_bound(
    slot_expert_time: Number, dedup_expert_time: Number, bandwidth_error: Number
) -> Number:
    """(18): |S_hat(n) - S(n)| <= eps/(1-eps) (M^e_slot(n) + M^e_dedup(n)).

    The arguments are the expert times M^e_p(n) = E_p(n)/beta_p(n) of the two kernels.
    """
    slot_expert_time = check_non_negative(slot_expert_time, "slot_expert_time")
    dedup_expert_time = check_non_negative(dedup_expert_time, "dedup_expert_time")
    bandwidth_error = check_bandwidth_error(bandwidth_error)
    return bandwidth_error / (1 - bandwidth_error) * (slot_expert_time + dedup_expert_time)


def kernel_choice_is_robust(
    byte_share: Number, bandwidth_ratio: Number, bandwidth_error: Number
) -> bool:
    """(19): the predicted and the true faster kernel agree if |ln r - ln u| > ln((1+eps)/(1-eps)).

    Evaluated without logarithms as max(r/u, u/r) > (1+eps)/(1-eps), so it is exact on Fractions.
    """
    byte_share = check_positive(byte_share, "byte_share")
    bandwidth_ratio = check_positive(bandwidth_ratio, "bandwidth_ratio")
    bandwidth_error = check_bandwidth_error(bandwidth_error)
    margin = (1 + bandwidth_error) / (1 - bandwidth_error)
    return max(bandwidth_ratio / byte_share, byte_share / bandwidth_ratio) > margin


def throughput_loss_bound(step_time_error: Number) -> Number:
    """(20): drafting k_hat* loses at most 2 delta/(1 + delta) of the best throughput."""
    step_time_error = _check_delta(step_time_error)
    return 2 * step_time_error / (1 + step_time_error)


def best_draft_length_is_certain(
    step_times: Sequence[Number], acceptance: Number, step_time_error: Number
) -> bool:
    """(20): k_hat* = k* if (1+delta)/(1-delta) T_a(i) < T_a(k*) for every i != k*.

    The separation can be checked on either table: on the true step times (the theorem), or on
    the predicted ones (then T(k_hat*) >= (1-delta) T_hat(k_hat*) > (1+delta) T_hat(i) >= T(i),
    so the predicted best is the true best as well).
    """
    step_times = check_step_times(step_times)
    acceptance = check_acceptance(acceptance)
    step_time_error = _check_delta(step_time_error)
    best = _best_draft_length(step_times, acceptance)
    top = _throughput(step_times, acceptance, best)
    factor = (1 + step_time_error) / (1 - step_time_error)
    return all(
        factor * _throughput(step_times, acceptance, i) < top
        for i in range(len(step_times))
        if i != best
    )


def speedup_bounds(step_time_error: Number) -> tuple[Number, Number]:
    """(21): (1-delta)/(1+delta) <= [T_hat(k_hat*)/T_hat(0)] / [T(k*)/T(0)] <= (1+delta)/(1-delta).

    Returns the pair of factors (low, high) bounding predicted over true best speedup.
    """
    step_time_error = _check_delta(step_time_error)
    d = step_time_error
    return (1 - d) / (1 + d), (1 + d) / (1 - d)


def step_time_error(bandwidth_error: Number) -> Number:
    """(C.7): with bandwidth errors alone, delta = eps/(1 - eps) bounds the step-time error."""
    bandwidth_error = check_bandwidth_error(bandwidth_error)
    return bandwidth_error / (1 - bandwidth_error)


def speedup_error_factor(bandwidth_error: Number) -> Number:
    """(C.7): (1+delta)/(1-delta) = 1/(1 - 2 eps) for eps < 1/2; eps = 0.1 gives 1.25."""
    bandwidth_error = check_bandwidth_error(bandwidth_error)
    if not bandwidth_error * 2 < 1:
        raise ValueError(f"bandwidth_error must be below 1/2 for (C.7), got {bandwidth_error}")
    return 1 / (1 - 2 * bandwidth_error)


def _check_delta(step_time_error: Number) -> Number:
    return check_bandwidth_error(step_time_error, "step_time_error")
