"""The speculative utility estimator's transitions on hand-made frequency sequences (§3.2)."""

import pytest

from moespec.offload.policies.estimator import UtilityEstimator, default_max_utility


def utilities(sequence, **settings):
    estimator = UtilityEstimator(1, 1, **settings)
    return [int(estimator.update(0, [f])[0]) for f in sequence]


def test_k_follows_the_logarithmic_guideline():
    assert default_max_utility(8) == 4  # eight drafts: ceil(log2 9)
    assert [default_max_utility(g) for g in (0, 1, 2, 3, 4, 15, 16)] == [1, 1, 2, 2, 3, 4, 5]


def test_level_reading_climbs_one_step_at_a_time_against_calibrated_boundaries():
    # Window of 9 tokens (gamma = 8), K = 4: level(u) = 2.25 u, boundaries start at 4.
    # f = 9: Delta = 9 >= 4 -> u = 1, theta_up = 0.9 * 4 + 0.1 * 9 = 4.5
    # f = 9: Delta = 9 - 2.25 = 6.75 >= 4.5 -> u = 2, theta_up = 4.725
    # f = 9: Delta = 9 - 4.5 = 4.5 < 4.725 -> u stays 2, theta_up = 4.7025
    # f = 0: Delta = -4.5, theta_down = 4 -> u = 1
    assert utilities([9, 9, 9, 0], window_tokens=9) == [1, 2, 2, 1]


def test_utility_is_clipped_to_zero_and_k():
    assert utilities([0, 0, 0], window_tokens=9) == [0, 0, 0]
    assert utilities([9] * 40, window_tokens=9, max_utility=2)[-1] == 2


def test_literal_reading_follows_the_frequency_fluctuation():
    # Delta = f_t - f_{t-1}; boundaries 4: a rise of 5 lifts u, a steady 5 keeps it,
    # a fall of 5 drops it.
    assert utilities([0, 5, 5, 0], window_tokens=9, reference="previous") == [0, 1, 1, 0]


def test_fixed_boundaries_are_three_up_and_one_down():
    seq = [0, 2, 5, 4]  # Delta: 0, +2 (< 3), +3 (>= 3), -1 (>= 1)
    assert utilities(seq, window_tokens=9, reference="previous", adaptive=False) == [0, 0, 1, 0]


def test_adaptive_boundaries_move_by_the_sign_of_the_fluctuation():
    estimator = UtilityEstimator(1, 1, window_tokens=9, reference="previous")
    estimator.update(0, [2])  # Delta = +2: theta_up = 0.9 * 4 + 0.2 = 3.8
    estimator.update(0, [0])  # Delta = -2: theta_down = 0.9 * 4 + 0.2 = 3.8
    estimator.update(0, [0])  # Delta = 0: neither moves
    assert estimator.theta_up[0, 0] == pytest.approx(3.8)
    assert estimator.theta_down[0, 0] == pytest.approx(3.8)


def test_binary_utility_without_the_estimator_is_k_equal_one():
    assert utilities([9, 9, 0, 9], window_tokens=9, max_utility=1) == [1, 1, 0, 1]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="forgetting"):
        UtilityEstimator(1, 1, window_tokens=9, forgetting=0)
    with pytest.raises(ValueError, match="reference"):
        UtilityEstimator(1, 1, window_tokens=9, reference="trend")
