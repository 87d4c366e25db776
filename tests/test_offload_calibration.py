"""The calibration gate's checks on hand-made figures (the simulations live in a benchmark)."""

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
