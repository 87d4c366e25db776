"""Speculation on any positive step time: throughput, best draft length, staircase.

Seed 000 §3.2-3.3 and Appendix B.

A step drafts k tokens and verifies k + 1 in one pass; it costs V(k) = step_times[k] > 0. Under
geometric acceptance a in [0, 1) it emits G_a(k) = 1 + a + ... + a^k tokens on average, so its
throughput is T_a(k) = G_a(k) / V(k). Everything here is exact on `fractions.Fraction` inputs
(and works on floats); nothing assumes a shape of V beyond positivity unless a docstring says so.
"""

from collections.abc import Sequence
from fractions import Fraction

from moespec.costmodel._checks import (
    Number,
    check_acceptance,
    check_draft_length,
    check_step_times,
)

# Step points are found by bisection to this width (the issue asks for <= 1e-12).
STEP_POINT_TOLERANCE = 2.0**-44


def expected_tokens(acceptance: Number, draft_length: int) -> Number:
    """G_a(k) = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a): tokens emitted per step (Sec. 1)."""
    acceptance = check_acceptance(acceptance)
    if isinstance(draft_length, bool) or not isinstance(draft_length, int) or draft_length < 0:
        raise ValueError(f"draft_length must be a non-negative integer, got {draft_length!r}")
    return _geometric_sum(acceptance, draft_length)


def _geometric_sum(x: Number, k: int) -> Number:
    """P_k(x) = 1 + x + ... + x^k by Horner's rule (exact on Fractions, no division)."""
    total = 1
    for _ in range(k):
        total = total * x + 1
    return total


def throughput(step_times: Sequence[Number], acceptance: Number, draft_length: int) -> Number:
    """T_a(k) = G_a(k) / V(k), tokens per unit of step time (Sec. 1)."""
    step_times = check_step_times(step_times)
    acceptance = check_acceptance(acceptance)
    check_draft_length(draft_length, step_times)
    return _throughput(step_times, acceptance, draft_length)


def _throughput(step_times, acceptance, draft_length):
    return _geometric_sum(acceptance, draft_length) / step_times[draft_length]


def best_draft_length(step_times: Sequence[Number], acceptance: Number) -> int:
    """k*(a): the smallest k in 0..k_max that maximises T_a(k) (Sec. 1; staircase of Sec. 3.3)."""
    step_times = check_step_times(step_times)
    acceptance = check_acceptance(acceptance)
    return _best_draft_length(step_times, acceptance)


def _best_draft_length(step_times, acceptance) -> int:
    best_k, best = 0, _throughput(step_times, acceptance, 0)
    for k in range(1, len(step_times)):
        value = _throughput(step_times, acceptance, k)
        if value > best:  # strict: ties keep the smaller draft length
            best_k, best = k, value
    return best_k


def speedup(step_times: Sequence[Number], acceptance: Number, draft_length: int) -> Number:
    """T_a(k) / T_a(0) = G_a(k) V(0) / V(k), eq. (9) and (B.17)."""
    step_times = check_step_times(step_times)
    acceptance = check_acceptance(acceptance)
    check_draft_length(draft_length, step_times)
    return _geometric_sum(acceptance, draft_length) * step_times[0] / step_times[draft_length]


def faster_than_plain(step_times: Sequence[Number], acceptance: Number, draft_length: int) -> bool:
    """Eq. (8): T_a(k) > T_a(0) iff V(k) - V(0) < (a + ... + a^k) V(0).

    The time a draft of length k adds must be below the expected accepted drafts times a plain step.
    """
    step_times = check_step_times(step_times)
    acceptance = check_acceptance(acceptance)
    check_draft_length(draft_length, step_times)
    accepted = _geometric_sum(acceptance, draft_length) - 1
    return step_times[draft_length] - step_times[0] < accepted * step_times[0]


def first_draft_threshold(step_times: Sequence[Number]) -> Number:
    """a0 = V(1)/V(0) - 1 (B.4): one draft is faster than none exactly when a > a0."""
    step_times = check_step_times(step_times, min_length=2)
    return step_times[1] / step_times[0] - 1


def crossing_acceptance(step_times: Sequence[Number], draft_length: int, other: int) -> Number:
    """alpha_{k,i}: the least acceptance above which draft length k beats i < k in throughput.

    Appendix B.3: T_a(k) > T_a(i) iff G_a(k)/G_a(i) > V(k)/V(i) (B.27), and the left side rises
    strictly with a from 1 at a = 0 towards (k+1)/(i+1) as a -> 1 (B.26). So the set of such a is
    an interval (alpha, 1): alpha = 0 when V(k) <= V(i); alpha = 1 (never) when
    V(k)/V(i) >= (k+1)/(i+1); otherwise alpha is the single root in (0, 1) of
    P_k(a) V(i) - P_i(a) V(k), found by **bisection** on that monotone comparison to a width of
    2^-44 (< 1e-12). Comparisons are exact on Fractions, so the bracket is rigorous; a rational
    root with a small denominator is then recognised and returned exactly.
    """
    step_times = check_step_times(step_times)
    k, i = draft_length, other
    check_draft_length(k, step_times)
    check_draft_length(i, step_times)
    if not i < k:
        raise ValueError(f"other must be below draft_length, got other={i}, draft_length={k}")
    return _crossing_acceptance(step_times, k, i)


def _crossing_acceptance(step_times, k: int, i: int) -> Number:
    v_k, v_i = step_times[k], step_times[i]
    if v_k <= v_i:
        return _like(v_k, 0)
    if v_k * (i + 1) >= v_i * (k + 1):
        return _like(v_k, 1)

    def k_wins(a):
        return _geometric_sum(a, k) * v_i > _geometric_sum(a, i) * v_k

    return _bisect_threshold(
        k_wins,
        exact=_is_exact(v_k, v_i),
        zero=lambda a: _geometric_sum(a, k) * v_i == _geometric_sum(a, i) * v_k,
    )


def _is_exact(*values) -> bool:
    return all(isinstance(v, int | Fraction) for v in values)


def _like(reference, value):
    """`value` as a Fraction when the inputs are exact, else as a float."""
    return Fraction(value) if _is_exact(reference) else float(value)


def _bisect_threshold(holds, *, exact: bool, zero) -> Number:
    """Infimum of an upward-closed set {a in [0, 1): holds(a)}; holds(0) false, holds(1-) true."""
    lo, hi = (Fraction(0), Fraction(1)) if exact else (0.0, 1.0)
    while hi - lo > STEP_POINT_TOLERANCE:
        mid = (lo + hi) / 2
        if holds(mid):
            hi = mid
        else:
            lo = mid
    if exact:
        # The boundary is often rational with a small denominator (e.g. c1/V(0)); return it exactly.
        guess = ((lo + hi) / 2).limit_denominator(10**5)
        if lo <= guess <= hi and zero(guess):
            return guess
    return (lo + hi) / 2


def step_points(step_times: Sequence[Number]) -> list[Number]:
    """[a_1, ..., a_kmax], eq. (B.31): a_j = max_{i<j} min_{k>=j} alpha_{k,i}.

    a_j is the infimum of the acceptances at which k*(a) >= j (1 when there is none):
    k*(a) >= j for every a in (a_j, 1) and k*(a) < j for every a in [0, a_j).
    """
    step_times = check_step_times(step_times, min_length=2)
    k_max = len(step_times) - 1
    alpha = {
        (k, i): _crossing_acceptance(step_times, k, i)
        for k in range(1, k_max + 1)
        for i in range(k)
    }
    return [
        max(min(alpha[k, i] for k in range(j, k_max + 1)) for i in range(j))
        for j in range(1, k_max + 1)
    ]


def draft_increments(step_times: Sequence[Number]) -> list[Number]:
    """c_i = V(i) - V(i-1), i = 1..k_max: the time the i-th draft adds."""
    step_times = check_step_times(step_times, min_length=2)
    return [step_times[i] - step_times[i - 1] for i in range(1, len(step_times))]


def has_convex_increments(step_times: Sequence[Number]) -> bool:
    """0 <= c_1 <= c_2 <= ...: V convex and non-decreasing, the hypothesis of (10)/(B.36)."""
    c = draft_increments(step_times)
    return c[0] >= 0 and all(c[i] <= c[i + 1] for i in range(len(c) - 1))


def convex_reaches(step_times: Sequence[Number], acceptance: Number, j: int) -> bool:
    """The closed test (10): k*(a) >= j iff a^j V(j-1) > G_a(j-1) c_j.

    Valid only under convex increments 0 <= c_1 <= c_2 <= ... (checked): then j and j-1 alone
    decide whether the staircase reaches j.
    """
    step_times = check_step_times(step_times, min_length=2)
    acceptance = check_acceptance(acceptance)
    _check_convex(step_times)
    if isinstance(j, bool) or not isinstance(j, int) or not 1 <= j < len(step_times):
        raise ValueError(f"j must be in 1..{len(step_times) - 1}, got {j!r}")
    c_j = step_times[j] - step_times[j - 1]
    return acceptance**j * step_times[j - 1] > _geometric_sum(acceptance, j - 1) * c_j


def step_points_convex(step_times: Sequence[Number]) -> list[Number]:
    """Step points under convex increments from (B.36): a_1 = min(c_1/V(0), 1) exactly, and
    a_j = inf{a : h_j(a) > c_j/V(j-1)} with h_j(a) = a^j / G_a(j-1) strictly increasing
    (bisection to 2^-44). An independent route to the same numbers as `step_points`.
    """
    step_times = check_step_times(step_times, min_length=2)
    _check_convex(step_times)
    c = draft_increments(step_times)
    exact = _is_exact(*step_times)
    points = [min(c[0] / step_times[0], _like(step_times[0], 1))]
    for j in range(2, len(step_times)):
        bar = c[j - 1] / step_times[j - 1]
        if bar <= 0:
            points.append(_like(step_times[0], 0))
        elif bar * j >= 1:  # h_j(a) < 1/j for every a < 1
            points.append(_like(step_times[0], 1))
        else:
            points.append(
                _bisect_threshold(
                    lambda a, j=j, bar=bar: a**j > _geometric_sum(a, j - 1) * bar,
                    exact=exact,
                    zero=lambda a, j=j, bar=bar: a**j == _geometric_sum(a, j - 1) * bar,
                )
            )
    return points


def _check_convex(step_times) -> None:
    if not has_convex_increments(step_times):
        raise ValueError(
            "step_times must have non-decreasing, non-negative increments (0 <= c_1 <= c_2 <= ...) "
            f"for the convex-case test, got c = {draft_increments(step_times)}"
        )
