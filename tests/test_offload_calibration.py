"""The calibration gate's checks on hand-made figures (the simulations live in a benchmark)."""

import pytest

from moespec.offload.sim.calibration import checks


def figures(**changes):
    base = {
        "static_tokens_per_second": 17.7,
        "static_ar_tokens_per_second": 15.2,
        "hybrid_ar_tokens_per_second": 12.1,
        "spac_layer_ms": 0.75,
        "spac_tokens_per_second_by_gamma": {2: 18.0, 4: 21.0, 6: 23.0, 8: 25.0},
    }
    return {**base, **changes}


def test_the_paper_figures_meet_the_gate():
    assert checks(figures())["met"]


def test_each_check_fails_on_its_own():
    assert not checks(figures(static_tokens_per_second=12.0))["sd_ratio"]["met"]
    assert not checks(figures(hybrid_ar_tokens_per_second=16.0))["hybrid_below"]["met"]
    assert not checks(figures(spac_layer_ms=2.0))["spac_layer_ms"]["met"]
    falling = {2: 24.0, 4: 21.0, 6: 23.0, 8: 25.0}
    result = checks(figures(spac_tokens_per_second_by_gamma=falling))
    assert not result["gamma_rising"]["met"] and not result["met"]
    assert result["sd_ratio"]["met"] and result["spac_layer_ms"]["met"]


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
    runs = {"static": run(30, 10, 1.0, draft=0.4, passes=0.6), "static-ar": run(50, 50, 1.0)}
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
    assert rows[0]["static_drafted_per_step"] > 7.5 > 2 * rows[1]["static_drafted_per_step"]
    assert rows[1]["sd_ratio"] > rows[0]["sd_ratio"]
    assert all(list(r["spac_tokens_per_second_by_gamma"]) == [2, 4, 6, 8] for r in rows)
