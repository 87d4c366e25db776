"""The worked examples of seed 000, exactly, in Fractions."""

from fractions import Fraction

from hypothesis import given
from hypothesis import strategies as st

from moespec.costmodel import (
    best_draft_length,
    dedup_expert_bytes,
    mean_reuse,
    reuse_threshold_bytes,
    step_points,
)

F = Fraction


def periodic_reuse(pattern: str, n: int) -> Fraction:
    """rho(n), eq. (1), of a stationary process repeating `pattern` from a uniform random phase.

    One expert per token (m = 1): the share of phases at which the n-th token of the window
    repeats an expert of the n - 1 tokens before it.
    """
    period = len(pattern)
    hits = 0
    for start in range(period):
        window = [pattern[(start + i) % period] for i in range(n)]
        hits += window[-1] in window[:-1]
    return F(hits, period)


def test_no_single_threshold_example_b2():
    # N = 3, L = 1, m = 1, w = 1, D = 0, kv = 0, k_max = 2, a = 13/20.
    a, top_k, expert_bytes = F(13, 20), 1, [F(1)]
    plain_bytes = top_k * sum(expert_bytes)  # V_dedup(0) = D + m W + kv(0)
    thresholds = [
        reuse_threshold_bytes(
            a, k, plain_step_bytes=plain_bytes, top_k=top_k, total_expert_bytes=sum(expert_bytes)
        )
        for k in (1, 2)
    ]
    assert thresholds == [F(7, 20), F(371, 800)]

    expected = {
        "01": (F(0), F(1, 2), True),
        "00012": (F(2, 5), F(2, 5), True),
        "00102": (F(1, 5), F(2, 5), False),
    }
    for pattern, (rho_bar_1, rho_bar_2, has_speedup) in expected.items():
        reuse = [[periodic_reuse(pattern, n) for n in range(1, 4)]]
        rho_bars = [mean_reuse(reuse, expert_bytes, k) for k in (1, 2)]
        assert rho_bars == [rho_bar_1, rho_bar_2], pattern
        # Byte cost with one bandwidth: V(k) = D + E_dedup(k + 1) + kv(k).
        step_times = [plain_bytes] + [
            dedup_expert_bytes(sum(expert_bytes), top_k, k, rho_bars[k - 1]) for k in (1, 2)
        ]
        assert (best_draft_length(step_times, a) >= 1) == has_speedup, pattern
        # ... and the thresholds agree with the byte cost at every k.
        for k in (1, 2):
            assert (rho_bars[k - 1] > thresholds[k - 1]) == (
                step_times[k] / step_times[0] < 1 + sum(a**i for i in range(1, k + 1))
            )


def test_staircase_jumps_over_one_example_b3():
    # Two experts alternating (N = 2, m = 1, w = 1): V_dedup = (1, 2, 2).
    rho = [periodic_reuse("01", n) for n in (1, 2, 3)]
    step_times = [F(1)] + [
        dedup_expert_bytes(F(1), 1, k, mean_reuse([rho], [F(1)], k)) for k in (1, 2)
    ]
    assert step_times == [1, 2, 2]
    assert best_draft_length(step_times, F(1, 2)) == 0
    assert best_draft_length(step_times, F(9, 10)) == 2
    a_1, a_2 = step_points(step_times)
    assert a_1 == a_2  # no acceptance has k* = 1
    assert all(best_draft_length(step_times, F(i, 1000)) != 1 for i in range(1000))


@given(
    st.fractions(min_value=F(1, 100), max_value=F(99, 100), max_denominator=997),
    st.integers(1, 8),
    st.fractions(min_value=0, max_value=F(99, 100), max_denominator=1009),
)
def test_leviathan_affine_case(chi, k_max, a):
    # V(k) = 1 + chi k: some draft length k > 0 is faster than none iff a > chi.
    step_times = [1 + chi * k for k in range(k_max + 1)]
    assert (best_draft_length(step_times, a) >= 1) == (a > chi)
    assert step_points(step_times)[0] == chi
