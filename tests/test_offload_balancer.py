"""The workload balancer's threshold tau (seed 003 §3.3, App. C): exact, and honest when no tau
meets the constraints."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from moespec.offload.policies.balancer import WorkloadBalancer, link_fetches, solve_threshold


def brute_force(
    utilities,
    absent,
    io_window,
    io_per_copy,
    free_bytes,
    cached_bytes_by_level,
    expert_bytes,
    cpu_share,
    gpu_share,
    slots,
    distinct,
    cpu_unit,
    gpu_unit,
):
    """Straight from the formulation: every tau, both constraints written out separately."""
    k = len(cpu_share)
    candidates = []
    for tau in range(1, k + 1):
        n = sum(1 for u, a in zip(utilities, absent, strict=True) if a and u >= tau)
        vram_left = free_bytes + sum(cached_bytes_by_level[:tau])
        io_ok = io_per_copy * n <= io_window
        memory_ok = expert_bytes * n <= vram_left
        t_cpu = cpu_share[tau - 1] * slots * cpu_unit
        t_gpu = gpu_share[tau - 1] * distinct * gpu_unit
        over = max(n - io_window / io_per_copy, n - vram_left / expert_bytes, 0)
        candidates.append((not (io_ok and memory_ok), over, abs(t_cpu - t_gpu), tau))
    return min(candidates)


@st.composite
def instances(draw):
    k = draw(st.integers(1, 8))
    n = draw(st.integers(1, 40))
    units = st.floats(1e-5, 1e-2)
    return dict(
        utilities=draw(st.lists(st.integers(0, k), min_size=n, max_size=n)),
        absent=draw(st.lists(st.booleans(), min_size=n, max_size=n)),
        io_window=draw(st.floats(0, 0.05)),
        io_per_copy=draw(units),
        free_bytes=draw(st.integers(0, 10)) * 1000,
        cached_bytes_by_level=[draw(st.integers(0, 6)) * 1000 for _ in range(k + 1)],
        expert_bytes=1000,
        cpu_share=sorted(draw(st.lists(st.floats(0, 1), min_size=k, max_size=k))),
        gpu_share=sorted(draw(st.lists(st.floats(0, 1), min_size=k, max_size=k)), reverse=True),
        slots=draw(st.integers(1, 80)),
        distinct=draw(st.integers(1, 40)),
        cpu_unit=draw(units),
        gpu_unit=draw(units),
    )


def solve(i):
    k = len(i["cpu_share"])
    u, absent = np.array(i["utilities"]), np.array(i["absent"])
    prefetch = [int(((u >= tau) & absent).sum()) for tau in range(1, k + 1)]
    memory = (i["free_bytes"] + np.cumsum(i["cached_bytes_by_level"])[:k]) / i["expert_bytes"]
    cpu = np.array(i["cpu_share"]) * i["slots"] * i["cpu_unit"]
    gpu = np.array(i["gpu_share"]) * i["distinct"] * i["gpu_unit"]
    return solve_threshold(prefetch, i["io_window"] / i["io_per_copy"], memory, cpu, gpu)


@given(instances())
def test_tau_equals_brute_force_on_random_instances(instance):
    infeasible, violation, objective, tau = brute_force(**instance)
    choice = solve(instance)
    assert choice.tau == tau
    assert choice.feasible == (not infeasible)
    assert np.isclose(choice.objective, objective)


def test_infeasible_constraints_fall_back_to_the_least_violating_tau_and_say_so():
    # n(tau) = 9, 6, 4 and the link moves 2 experts in the window: every tau violates.
    choice = solve_threshold([9, 6, 4], 2.0, [100, 100, 100], [1.0, 2.0, 3.0], [3.0, 2.0, 1.0])
    assert (choice.tau, choice.feasible, choice.violation) == (3, False, 2.0)


def test_among_feasible_taus_the_most_balanced_wins():
    choice = solve_threshold([3, 2, 1], 10.0, [10, 10, 10], [1.0, 2.0, 3.0], [3.0, 2.1, 1.0])
    assert (choice.tau, choice.feasible) == (2, True)
    assert choice.objective == pytest.approx(0.1)


def test_memory_left_can_make_small_taus_infeasible():
    choice = solve_threshold([5, 1], 10.0, [4, 4], [0.0, 5.0], [0.0, 0.0])
    assert (choice.tau, choice.feasible) == (2, True)


def test_warm_up_learns_cpu_and_gpu_shares_per_threshold():
    balancer = WorkloadBalancer(num_layers=1, max_utility=2)
    # Needed experts with utilities 0, 1, 2 and slot counts 1, 1, 2.
    balancer.record(0, np.array([0, 1, 2]), np.array([1, 1, 2]))
    # tau = 1: only the utility-0 expert is cold: r_c = 1/4 of slots, r_g = 2/3 of experts.
    # tau = 2: utilities 0 and 1 are cold: r_c = 2/4, r_g = 1/3.
    r_c, r_g = balancer.shares(0)
    assert np.allclose(r_c, [0.25, 0.5])
    assert np.allclose(r_g, [2 / 3, 1 / 3])
    assert balancer.distinct[0] == 3
    # A second pass, one expert at utility 0 with 8 slots (r_c = 1, 1; r_g = 0, 0): the shares
    # are means over passes (App. C.1), not ratios of summed slots (which would give 9/12).
    balancer.record(0, np.array([0]), np.array([8]))
    r_c, r_g = balancer.shares(0)
    assert np.allclose(r_c, [(0.25 + 1) / 2, (0.5 + 1) / 2])
    assert np.allclose(r_g, [(2 / 3) / 2, (1 / 3) / 2])


def test_the_link_takes_misses_while_the_cpu_queue_would_finish_later():
    # Four misses of 1 ms each on the CPU; a copy + compute takes 0.6 ms. Fetching j of them
    # finishes at max(4 - j, 0.6 j) ms: 2 at j = 2, 1.8 at j = 3, 2.4 at j = 4: j = 3.
    assert link_fetches([1e-3] * 4, link_backlog=0, copy_seconds=0.5e-3,
                        accelerator_seconds=0.1e-3) == 3  # fmt: skip
    # A busy link (5 ms of copies queued): no miss gains by waiting for it.
    assert link_fetches([1e-3] * 4, link_backlog=5e-3, copy_seconds=0.5e-3,
                        accelerator_seconds=0.1e-3) == 0  # fmt: skip
    assert link_fetches([], link_backlog=0, copy_seconds=1e-3, accelerator_seconds=0) == 0


@given(
    st.integers(1, 5).flatmap(
        lambda k: st.tuples(
            st.just(k),
            st.lists(st.tuples(st.integers(0, k), st.integers(1, 9)), min_size=1, max_size=12),
        )
    )
)
def test_recorded_shares_are_the_counts_of_each_threshold(case):
    """r_c(tau) and r_g(tau) against a loop over the experts (the definition, eq. 7-8)."""
    k, rows = case
    balancer = WorkloadBalancer(num_layers=1, max_utility=k)
    utilities = np.array([u for u, _ in rows])
    counts = np.array([c for _, c in rows])
    balancer.record(0, utilities, counts)
    total = sum(c for _, c in rows)
    r_c, r_g = balancer.shares(0)
    for tau in range(1, k + 1):
        cold_slots = sum(c for u, c in rows if u < tau)
        hot_experts = sum(1 for u, _ in rows if u >= tau)
        assert r_c[tau - 1] == pytest.approx(cold_slots / total, rel=1e-12, abs=1e-15)
        assert r_g[tau - 1] == pytest.approx(hot_experts / len(rows), rel=1e-12, abs=1e-15)


# Beyond the paper: tiers on one processor (serial > 0). K = 3; tau = 1..3, and 4 = no prefetch.
SERIAL_CASE = dict(
    prefetch_counts=[6, 3, 1],
    io_capacity=100.0,
    memory_capacity=[10, 10, 10],
    cpu_times=[0.2, 0.5, 0.8],  # T_cpu(tau): more of the pass on the CPU as tau rises
    gpu_times=[0.8, 0.5, 0.2],
)


def test_tiers_on_one_processor_prefetch_nothing_when_a_copy_wins_nothing_back():
    # Equal work either way (T_cpu + T_gpu = 1.0 at every tau, all on the CPU 1.0): each copy
    # only adds its 0.1 s, so the layer's time is 1.0 + 0.1 n(tau) and no prefetch is best.
    choice = solve_threshold(**SERIAL_CASE, serial=1.0, copy_seconds=0.1, all_cpu_seconds=1.0)
    assert (choice.tau, choice.objective) == (4, 1.0)


def test_tiers_on_one_processor_still_prefetch_what_a_faster_accelerator_wins_back():
    # The accelerator does its share in a tenth of the time: tau = 1 takes 0.2 + 0.08 + 0.06
    # (against 0.58, 0.83 and 1.0).
    fast = {**SERIAL_CASE, "gpu_times": [0.08, 0.05, 0.02]}
    choice = solve_threshold(**fast, serial=1.0, copy_seconds=0.01, all_cpu_seconds=1.0)
    assert choice.tau == 1
    assert choice.objective == pytest.approx(0.2 + 0.08 + 6 * 0.01)
    # Half of the shorter tier hidden: max + 0.5 (min + n copy), tau = 1 again (0.27 against
    # 0.54, 0.81 and 1.0).
    half = solve_threshold(**fast, serial=0.5, copy_seconds=0.01, all_cpu_seconds=1.0)
    assert half.tau == 1 and half.objective == pytest.approx(0.2 + 0.5 * (0.08 + 0.06))


def test_a_device_of_its_own_keeps_the_papers_objective_and_candidates():
    # serial = 0: |T_cpu - T_gpu|, least at tau = 2 (0.0); no-prefetch is never a candidate.
    choice = solve_threshold(**SERIAL_CASE, copy_seconds=0.1, all_cpu_seconds=0.0)
    assert (choice.tau, choice.objective) == (2, 0.0)


def test_tiers_on_one_processor_run_a_layer_whole_where_a_split_costs_more():
    # Nothing to prefetch at any tau; the CPU alone takes 1.1 against 1.0 for both tiers at
    # tau = 1..3, until a split costs 0.2 more: then tau = 4, the layer in one call on the CPU.
    none = {**SERIAL_CASE, "prefetch_counts": [0, 0, 0]}
    cheap = solve_threshold(**none, serial=1.0, all_cpu_seconds=1.1)
    assert (cheap.tau, cheap.objective) == (1, 1.0)
    costly = solve_threshold(**none, serial=1.0, split_seconds=0.2, all_cpu_seconds=1.1)
    assert (costly.tau, costly.objective) == (4, 1.1)
    # A tier left empty is no split: T_gpu = 0 at tau = 3 costs no split time.
    empty = {**none, "gpu_times": [0.8, 0.5, 0.0], "cpu_times": [0.2, 0.5, 1.05]}
    assert solve_threshold(**empty, serial=1.0, split_seconds=0.2, all_cpu_seconds=1.1).tau == 3


def test_unit_times_learn_what_a_split_layer_costs_beyond_its_tiers():
    from moespec.offload.policies.base import LayerTiming, UnitTimes

    times = UnitTimes(num_layers=1)
    split = LayerTiming(0, 1.0, 0.3, 4, 2, 0.4, 2, 0.0, 0)  # 0.3 s beyond the tiers
    times.observe_layer(split)
    assert times.split_seconds is None  # no one-tier pass to compare with yet
    times.observe_layer(LayerTiming(0, 0.6, 0.5, 6, 3, 0.0, 0, 0.0, 0))  # 0.1 s beyond
    times.observe_layer(LayerTiming(0, 0.5, 0.0, 0, 0, 0.3, 3, 0.0, 0))  # 0.2 s beyond
    assert times.split_seconds == pytest.approx(0.3 - 0.15)
    # tiers that overlap can make a split layer shorter than its tiers: no negative cost
    times.observe_layer(LayerTiming(0, 0.1, 0.3, 4, 2, 0.4, 2, 0.0, 0))
    assert times.split_seconds == 0.0
