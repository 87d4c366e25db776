"""Seed 000 §3.1 and §3.4: bytes, verify time, saving, crossover and the reuse threshold."""

from fractions import Fraction

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from moespec.costmodel import (
    best_draft_length,
    byte_share,
    crossover,
    dedup_expert_bytes,
    dedup_is_faster,
    expected_tokens,
    mean_reuse,
    pass_bytes,
    reuse_threshold,
    reuse_threshold_bytes,
    saving,
    slot_expert_bytes,
    speedup,
    throughput,
    uniform_reuse,
    uniform_union,
    union_expert_bytes,
    union_from_reuse,
    verify_time,
)
from tests.strategies import acceptances, non_negative, positive, unit

F = Fraction


def test_verify_time_5_adds_its_four_terms():
    t = verify_time(
        F(600),
        F(3),
        pass_dense_bytes=F(100),
        dense_bandwidth=F(50),
        outside_time=F(1, 2),
        fixed_work=F(1, 4),
    )
    assert t == F(1, 2) + 2 + 200 + F(1, 4)


@given(
    positive,
    positive,
    unit,
    st.fractions(min_value=F(1, 10), max_value=2, max_denominator=97),
    positive,
    positive,
    non_negative,
)
def test_saving_6_equals_difference_of_verify_times(
    e_slot, b_slot, share, ratio, dense, b_dense, fixed
):
    # tau_dedup moves u E_slot bytes at r beta_slot; t0, dense reads and equal fixed work cancel.
    common = {"pass_dense_bytes": dense, "dense_bandwidth": b_dense, "outside_time": fixed}
    slot = verify_time(e_slot, b_slot, fixed_work=fixed, **common)
    dedup = verify_time(share * e_slot, ratio * b_slot, fixed_work=fixed, **common)
    assert saving(e_slot, b_slot, share, ratio) == slot - dedup
    assert (slot - dedup > 0) == dedup_is_faster(share, ratio)  # eq. (7)


def test_saving_subtracts_unequal_fixed_work():
    assert saving(F(10), F(1), F(1, 2), F(1), fixed_work_gap=F(2)) == 3


def test_crossover_is_where_the_saving_stays_positive():
    assert crossover({1: 0, 2: -1, 3: 0.5, 4: -0.1, 5: 0.2, 6: 0.3}) == 5
    assert crossover([0, -1, -2]) is None
    assert crossover([0, 1, 2]) == 2  # a sequence starts at n = 1
    assert crossover({2: 1, 3: 1}) == 2
    assert crossover({2: 1, 3: -1}) is None


def test_union_from_reuse_2():
    assert union_from_reuse([0, F(1, 2), F(3, 4)], 4) == [4, 6, 7]


def test_union_from_reuse_requires_rho_1_zero():
    with pytest.raises(ValueError, match="rho\\(1\\)"):
        union_from_reuse([F(1, 10), F(1, 2)], 2)


@given(st.integers(2, 64), st.data())
def test_uniform_union_is_union_of_uniform_reuse(num_experts, data):
    top_k = data.draw(st.integers(1, num_experts - 1))
    n = data.draw(st.integers(1, 12))
    reuse = [uniform_reuse(num_experts, top_k, j) for j in range(1, n + 1)]
    assert union_from_reuse(reuse, top_k)[-1] == uniform_union(num_experts, top_k, n)


def test_uniform_union_closed_form():
    q = 1 - F(8, 64)
    assert uniform_union(64, 8, 3) == 64 * (1 - q**3)
    assert uniform_union(64, 8, 1) == 8


def test_byte_share_weights_layers_by_expert_bytes():
    # Two layers: w = 1, 3; U(2) = 3, 4 of n m = 4 slots.
    assert byte_share([3, 4], [1, 3], top_k=2, n_tokens=2) == F(1 * 3 + 3 * 4, 4 * 4)


def test_byte_share_carries_the_byte_factor_of_each_layer():
    # f_l (seed 000 Table 6): the dedup kernel reads f_l w_l per distinct expert of layer l.
    shared = byte_share([3, 4], [1, 3], top_k=2, n_tokens=2, byte_factors=[F(10, 9), 1])
    assert shared == F(F(10, 9) * 3 + 3 * 4, 4 * 4)
    assert byte_share([3, 4], [1, 3], 2, 2, byte_factors=[1, 1]) == byte_share([3, 4], [1, 3], 2, 2)
    with pytest.raises(ValueError, match="f_l >= 1"):
        byte_share([3, 4], [1, 3], top_k=2, n_tokens=2, byte_factors=[F(1, 2), 1])


@given(st.lists(st.lists(unit, min_size=4, max_size=4), min_size=1, max_size=3), st.data())
def test_dedup_bytes_12_equal_weighted_unions_2(reuse_tail, data):
    reuse_by_layer = [[F(0)] + r for r in reuse_tail]
    expert_bytes = data.draw(
        st.lists(positive, min_size=len(reuse_by_layer), max_size=len(reuse_by_layer))
    )
    top_k, k = data.draw(st.integers(1, 8)), data.draw(st.integers(1, 4))
    unions = [union_from_reuse(r, top_k)[k] for r in reuse_by_layer]
    by_layers = sum(w * u for w, u in zip(expert_bytes, unions, strict=True))
    rho_bar = mean_reuse(reuse_by_layer, expert_bytes, k)
    assert dedup_expert_bytes(sum(expert_bytes), top_k, k, rho_bar) == by_layers


@st.composite
def dedup_engines(draw):
    """The step time (B.10) of a deduplicating engine, f = 1, h = 0, with its parts."""
    return {
        "top_k": draw(st.integers(1, 8)),
        "total_expert_bytes": draw(positive),
        "plain_bandwidth": draw(positive),
        "dense_bandwidth": draw(positive),
        "outside_time": draw(non_negative),
        "plain_dense_bytes": draw(non_negative),
        "plain_fixed_work": draw(non_negative),
    }


def _plain_time(e):
    mw = e["top_k"] * e["total_expert_bytes"]
    return (
        e["outside_time"]
        + e["plain_dense_bytes"] / e["dense_bandwidth"]
        + mw / e["plain_bandwidth"]
        + e["plain_fixed_work"]
    )


def _draft_time(e, k, rho_bar, bandwidth, dense_growth, fixed_work_growth):
    mw = e["top_k"] * e["total_expert_bytes"]
    return (
        e["outside_time"]
        + (e["plain_dense_bytes"] + dense_growth) / e["dense_bandwidth"]
        + (mw + mw * k * (1 - rho_bar)) / bandwidth
        + e["plain_fixed_work"]
        + fixed_work_growth
    )


@given(dedup_engines(), st.integers(1, 6), acceptances, unit, positive, non_negative, st.data())
def test_reuse_threshold_14_decides_speedup_b14(e, k, a, rho_bar, bandwidth, dense_growth, data):
    # phi_dedup(k+1) >= 0, so the growth is at least -phi(1).
    fixed_work_growth = data.draw(unit) * 10 - e["plain_fixed_work"] * data.draw(unit)
    v0 = _plain_time(e)
    vk = _draft_time(e, k, rho_bar, bandwidth, dense_growth, fixed_work_growth)
    threshold = reuse_threshold(
        a,
        k,
        plain_verify_time=v0,
        top_k=e["top_k"],
        total_expert_bytes=e["total_expert_bytes"],
        bandwidth=bandwidth,
        plain_bandwidth=e["plain_bandwidth"],
        dense_growth=dense_growth,
        dense_bandwidth=e["dense_bandwidth"],
        fixed_work_growth=fixed_work_growth,
    )
    assume(rho_bar != threshold)
    table = [v0] + [vk] * k  # only V(0) and V(k) matter here
    assert (rho_bar > threshold) == (throughput(table, a, k) > throughput(table, a, 0))


@given(positive, non_negative, st.integers(1, 8), positive, st.integers(1, 6), acceptances, unit)
def test_reuse_threshold_bytes_16_is_the_one_bandwidth_case_of_14(
    dense, kv0, top_k, total, k, a, kv_step
):
    kv_growth = kv_step * 10
    plain_bytes = dense + top_k * total + kv0
    by_bytes = reuse_threshold_bytes(
        a,
        k,
        plain_step_bytes=plain_bytes,
        top_k=top_k,
        total_expert_bytes=total,
        kv_growth=kv_growth,
    )
    by_time = reuse_threshold(
        a,
        k,
        plain_verify_time=plain_bytes,
        top_k=top_k,
        total_expert_bytes=total,
        bandwidth=1,
        plain_bandwidth=1,
        dense_growth=kv_growth,
        dense_bandwidth=1,
    )
    assert by_bytes == by_time


@given(dedup_engines(), st.integers(1, 5), acceptances, st.data())
def test_more_reuse_never_removes_a_speedup_b20_b21(e, k_max, a, data):
    # Per-k bandwidths B_k and growths shared by both processes; reuse ordered rho <= rho'.
    bandwidths = data.draw(st.lists(positive, min_size=k_max, max_size=k_max))
    growths = data.draw(st.lists(non_negative, min_size=k_max, max_size=k_max))
    rho = data.draw(st.lists(unit, min_size=k_max, max_size=k_max))
    extra = data.draw(st.lists(unit, min_size=k_max, max_size=k_max))
    rho_more = [r + (1 - r) * x for r, x in zip(rho, extra, strict=True)]

    def table(reuse):
        return [_plain_time(e)] + [
            _draft_time(e, k, reuse[k - 1], bandwidths[k - 1], growths[k - 1], 0)
            for k in range(1, k_max + 1)
        ]

    less, more = table(rho), table(rho_more)
    if best_draft_length(less, a) >= 1:
        assert best_draft_length(more, a) >= 1
    for k in range(k_max + 1):
        assert speedup(more, a, k) >= speedup(less, a, k)


def test_reuse_threshold_falls_as_acceptance_rises_b19():
    args = {"plain_step_bytes": F(3), "top_k": 1, "total_expert_bytes": F(2)}
    values = [reuse_threshold_bytes(F(a, 10), 3, **args) for a in range(10)]
    assert all(values[i] > values[i + 1] for i in range(9))


def test_expected_tokens_in_threshold_matches_definition():
    # rho*_1 with V_dedup(0) = 1, m W = 1: 1 - a.
    assert reuse_threshold_bytes(
        F(2, 5), 1, plain_step_bytes=1, top_k=1, total_expert_bytes=1
    ) == 1 - (expected_tokens(F(2, 5), 1) - 1)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: uniform_union(8, 8, 2), "top_k must be below num_experts"),
        (lambda: uniform_union(8, 9, 2), "top_k must be below num_experts"),
        (lambda: byte_share([], [], 2, 2), "expert_bytes must list"),
        (lambda: byte_share([3], [1, 2], 2, 2), "one value per layer"),
        (lambda: byte_share([5], [1], 2, 2), "outside [m, n m]"),
        (lambda: crossover({}), "must not be empty"),
        (lambda: union_from_reuse([], 2), "non-empty"),
        (lambda: verify_time(1, 0), "bandwidth must be positive"),
        (lambda: verify_time(1, 1, pass_dense_bytes=5), "dense_bandwidth is required"),
        (lambda: saving(1, 1, F(3, 2), 1), "byte_share must be in [0, 1]"),
        (lambda: mean_reuse([[0, 1]], [1], 3), "needs rho(1..4)"),
    ],
)
def test_bad_inputs_raise_value_error_naming_the_argument(call, message):
    import re

    with pytest.raises(ValueError, match=re.escape(message)):
        call()


@given(
    st.lists(st.tuples(positive, unit), min_size=1, max_size=4),
    st.integers(1, 8),
    st.integers(1, 9),
    non_negative,
)
def test_only_routed_bytes_deduplicate_dense_bytes_cancel_in_the_pass_difference(
    layers, top_k, n, dense
):
    # Layer l's union U_l(n) lies in [m, n m]; shared experts and dense layers sit in D.
    expert_bytes = [w for w, _ in layers]
    unions = [top_k + s * (n - 1) * top_k for _, s in layers]
    slot = slot_expert_bytes(sum(expert_bytes), top_k, n)
    dedup = union_expert_bytes(unions, expert_bytes)
    assert dedup / slot == byte_share(unions, expert_bytes, top_k, n)
    assert dedup <= slot
    slot_pass, dedup_pass = pass_bytes(slot, dense), pass_bytes(dedup, dense)
    assert slot_pass - dedup_pass == slot - dedup  # D is read once by either kernel
    assert dedup_pass >= dense


def test_one_token_reads_m_experts_per_layer_with_either_kernel():
    expert_bytes, top_k = [F(3), F(5)], 2
    assert union_expert_bytes([top_k, top_k], expert_bytes) == slot_expert_bytes(8, top_k, 1)
    assert pass_bytes(slot_expert_bytes(8, top_k, 1), 100, kv_bytes=7) == 100 + 16 + 7
