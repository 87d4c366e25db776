"""Hot/cold accuracy and frequency sMAPE (seed 003 §4.3, App. B) on hand-computed cases."""

import numpy as np
import pytest

from moespec.offload.sim.metrics import (
    frequency_smape,
    history_ceiling,
    hot_cold_accuracy,
    smape_terms,
)


def test_smape_terms_follow_the_definition_and_are_zero_when_both_vanish():
    terms = smape_terms(np.array([0, 2, 1, 0]), np.array([0, 2, 3, 4]))
    # 0/0 -> 0; equal -> 0; 2*2/4 = 1; 2*4/4 = 2
    assert terms.tolist() == [0.0, 0.0, 1.0, 2.0]


def test_frequency_smape_averages_over_pairs_layers_and_experts():
    f = np.array([[[0, 2]], [[0, 2]], [[1, 1]]])  # [S=3, L=1, N=2]
    # pairs: (0,0)->0, (2,2)->0, then (0,1)->2, (2,1)->2/3: mean of 4 terms
    assert frequency_smape(f) == pytest.approx((0 + 0 + 2 + 2 / 3) / 4)


def test_accuracy_is_averaged_per_layer_then_over_layers():
    predicted = np.array([[[True, False, True], [True, True, True]]])  # [S=1, L=2, N=3]
    counts = np.array([[[1, 0, 0], [0, 0, 0]]])
    # layer 0: 2 of 3 right; layer 1: 0 of 3 right
    assert hot_cold_accuracy(predicted, counts) == pytest.approx((2 / 3 + 0) / 2)


def test_no_pairs_no_smape():
    assert frequency_smape(np.zeros((1, 2, 3))) is None


def test_history_ceiling_picks_the_best_forecast_of_each_history_in_hindsight():
    f = np.array([1, 0, 1, 0, 1, 0]).reshape(6, 1, 1)  # alternating; history of pass 0 is 0
    # after 0 always active, after 1 never: a forecast from one pass is always right...
    assert history_ceiling(f, depth=1) == 1.0
    # ...where "active in the previous pass" is always wrong
    previous = np.concatenate([np.zeros((1, 1, 1), bool), f[:-1] > 0])
    assert hot_cold_accuracy(previous, f) == 0.0


def test_two_passes_of_history_see_a_period_that_one_pass_cannot():
    g = np.array([1, 1, 0] * 4).reshape(12, 1, 1)
    # depth 1: after 0 (passes 0, 3, 6, 9) active 4 of 4; after 1 (8 passes) active 4 of 8
    assert history_ceiling(g, depth=1) == pytest.approx((4 + 4) / 12)
    assert history_ceiling(g, depth=2) == 1.0


def test_the_one_pass_ceiling_bounds_the_previous_pass_forecast():
    rng = np.random.default_rng(0)
    f = rng.poisson(0.6, size=(40, 3, 8))
    previous = np.concatenate([np.zeros((1, 3, 8), bool), f[:-1] > 0])
    one, two = history_ceiling(f, depth=1), history_ceiling(f, depth=2)
    assert hot_cold_accuracy(previous, f) <= one <= two <= 1.0
    assert history_ceiling(f[:0], depth=1) is None
