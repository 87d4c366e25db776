"""Hot/cold accuracy and frequency sMAPE (seed 003 §4.3, App. B) on hand-computed cases."""

import numpy as np
import pytest

from moespec.offload.sim.metrics import frequency_smape, hot_cold_accuracy, smape_terms


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
