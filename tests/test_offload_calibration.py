"""The calibration gate's checks on hand-made figures (the simulations live in a benchmark)."""

import pytest

from moespec.offload.sim.calibration import checks


def figures(**changes):
    base = {
        "llamacpp_tokens_per_second": 17.7,
        "llamacpp_ar_tokens_per_second": 15.2,
        "hybrid_ar_tokens_per_second": 12.1,
        "spac_layer_ms": 0.75,
        "spac_hit_rate": 0.73,
        "spac_tokens_per_second": 25.0,
        "spac_tokens_per_second_by_gamma": {2: 18.0, 4: 21.0, 6: 23.0, 8: 25.0},
    }
    return {**base, **changes}


def test_the_paper_figures_meet_the_gate():
    assert checks(figures())["met"]


def test_each_check_fails_on_its_own():
    assert not checks(figures(llamacpp_tokens_per_second=12.0))["sd_ratio"]["met"]
    assert not checks(figures(hybrid_ar_tokens_per_second=16.0))["hybrid_below"]["met"]
    # llama.cpp without speculation within 20% of 15.23 tokens/s: 12.69 .. 18.28 (the ratio
    # and the HybriMoE check move with it, so both speeds scale together here)
    for plain, met in [(12.6, False), (12.8, True), (18.2, True), (18.4, False)]:
        scaled = figures(
            llamacpp_ar_tokens_per_second=plain,
            llamacpp_tokens_per_second=plain * 17.7 / 15.2,
            hybrid_ar_tokens_per_second=plain * 0.8,
        )
        result = checks(scaled)
        assert result["llamacpp_ar"]["met"] is met and result["met"] is met
        assert result["sd_ratio"]["met"] and result["hybrid_below"]["met"]
    assert not checks(figures(spac_layer_ms=2.0))["spac_layer_ms"]["met"]
    falling = {2: 24.0, 4: 21.0, 6: 23.0, 8: 25.0}
    result = checks(figures(spac_tokens_per_second_by_gamma=falling))
    assert not result["gamma_rising"]["met"] and not result["met"]
    assert result["sd_ratio"]["met"] and result["spac_layer_ms"]["met"]
    # SpAc's cache hits within App. G's 0.70-0.75 widened by 20%: 0.5833 .. 0.90
    for hits, met in [(0.58, False), (0.59, True), (0.89, True), (0.91, False)]:
        result = checks(figures(spac_hit_rate=hits))
        assert result["spac_hit_rate"]["met"] is met and result["met"] is met
    # SpAc within 20% of Table 1's 25.06 tokens/s: 20.88 .. 30.07
    for spac, met in [(20.8, False), (21.0, True), (30.0, True), (30.2, False)]:
        assert checks(figures(spac_tokens_per_second=spac))["spac_tps"]["met"] is met


def test_a_fitted_ratio_is_marked_and_still_checked():
    assert checks(figures(), fitted=True)["sd_ratio"]["fitted"]
    assert not checks(figures())["sd_ratio"]["fitted"]
    assert not checks(figures(llamacpp_tokens_per_second=20.0), fitted=True)["sd_ratio"]["met"]


def test_table1_at_the_layer_time_leaves_three_draft_floors_per_drafted_token():
    from moespec.offload.sim.calibration import table1_draft_time

    got = table1_draft_time()
    # a = 0.73, gamma = 8: 3.4857 tokens a step; at 25.06 tokens/s a step of 139.09 ms, of
    # which 48 x 0.78 = 37.44 ms is the pass: (139.09 - 37.44) / 8 = 12.71 ms a drafted token,
    # against Qwen3-4B-FP8's 4.41 GB at 1008 GB/s = 4.376 ms
    tokens = (1 - 0.73**9) / 0.27
    assert got["tokens_per_step"] == pytest.approx(tokens)
    assert got["step_ms"] == pytest.approx(1e3 * tokens / 25.06)
    assert got["implied_ms_per_drafted_token"] == pytest.approx(12.707, abs=1e-3)
    assert got["over_floor"] == pytest.approx(12.707 / 4.376, abs=1e-3)


def test_table4_grows_less_than_its_drafts_take_at_the_bandwidth_floor():
    from moespec.offload.sim.calibration import table4_draft_bound

    bound = table4_draft_bound()
    # 4.41 GB per drafted token at 1008 GB/s: six drafts take 26.3 ms, above Table 4's 22.6 ms.
    assert bound["step_growth_ms_gamma_2_to_8"] == pytest.approx(22.59, abs=0.01)
    assert bound["six_drafts_floor_ms"] > bound["step_growth_ms_gamma_2_to_8"]
    assert not bound["consistent_with_serial_drafts"]


def test_the_free_pass_bound_of_static_with_speculation():
    from moespec.offload.sim.calibration import GAMMAS, reasons

    def run(tokens, steps, seconds, draft=0.0, passes=0.0):
        return dict(tokens=tokens, steps=steps, seconds=seconds, draft_seconds=draft,
                    pass_seconds=passes, tokens_per_second=tokens / seconds, cpu_experts=0,
                    needed_experts=8, num_layers=1, hit_rate=1.0)  # fmt: skip

    # 3 tokens per step, 40 ms of drafts per step, a plain token of 20 ms:
    # 3 / (40 + 20) ms = 50 tokens/s at best, against 50 without speculation: 1.0.
    runs = {
        "static-layers": run(30, 10, 1.0, draft=0.4, passes=0.6),
        "static-layers-ar": run(50, 50, 1.0),
    }
    runs.update({f"spac@{g}": run(30, 10, 1.0) for g in GAMMAS})
    sd = reasons(runs)["sd_ratio"]
    assert sd["best_ratio_with_a_free_pass"] == pytest.approx(1.0)
    assert sd["pass_over_plain_token"] == pytest.approx(3.0)


def test_the_stop_sweep_checks_the_drafting_at_each_recall():
    from moespec.offload import get_profile
    from moespec.offload.sim.calibration import stop_sweep
    from moespec.offload.sim.workload import synthetic_workload

    workload = synthetic_workload("olmoe-1b-7b", tokens=60, fit_tokens=40, seed=0)
    rows = stop_sweep(workload, get_profile("rtx4090-pcie4"), tokens=48, recalls=(0.0, 1.0))
    assert [r["draft_stop"] for r in rows] == [0.0, 1.0]
    # without the stop a step drafts gamma = 8 (short only at the trace's end); with it,
    # drafting ends at the first rejection: fewer drafts, so more tokens/s for the same steps
    assert rows[0]["llamacpp_drafted_per_step"] > 7.5 > 2 * rows[1]["llamacpp_drafted_per_step"]
    assert rows[1]["sd_ratio"] > rows[0]["sd_ratio"]
    assert all(list(r["spac_tokens_per_second_by_gamma"]) == [2, 4, 6, 8] for r in rows)


def test_the_draft_stop_is_fitted_to_the_papers_ratio():
    from moespec.offload import get_profile
    from moespec.offload.sim.calibration import LLAMACPP, fit_draft_stop, stop_sweep
    from moespec.offload.sim.workload import synthetic_workload

    workload = synthetic_workload("olmoe-1b-7b", tokens=80, fit_tokens=40, seed=0)
    profile = get_profile("rtx4090-avx2")
    fit = fit_draft_stop(workload, profile, tokens=64, iterations=6)
    assert fit["target"] == pytest.approx(17.66 / 15.23)
    ends = stop_sweep(workload, profile, tokens=64, recalls=(0.0, fit["draft_stop"], 1.0))
    ratios = [row["sd_ratio"] for row in ends]
    assert ratios[1] == pytest.approx(fit["sd_ratio"])  # the fit's ratio is what a run gives
    if ratios[0] < fit["target"] < ratios[2]:  # bracketed: bisection to 1/64 of the range
        assert 0 < fit["draft_stop"] < 1
        assert abs(fit["sd_ratio"] - fit["target"]) <= max(
            abs(r - fit["target"]) for r in (ratios[0], ratios[2])
        )
    else:  # out of reach: the nearer end
        assert fit["draft_stop"] in (0.0, 1.0)
    assert LLAMACPP == ("static-layers", "static-layers-ar")
