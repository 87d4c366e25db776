"""The layer driver's plan check: every needed expert computed exactly once, fetches absent and
on the accelerator, the other accelerator experts resident (seed 003's contract)."""

import numpy as np
import pytest

from moespec.offload.driver import PlanError, check_plan
from moespec.offload.policies.base import EMPTY, LayerPlan

PRESENT = np.array([True, True, False, False, True, False])  # experts 0, 1, 4 cached
NEEDED = np.array([0, 2, 3, 4])


def plan(accelerator, cpu, fetch=()):
    arrays = (np.array(x, dtype=np.int64) for x in (accelerator, cpu, fetch))
    return LayerPlan(*arrays)


def test_a_valid_plan_pins_its_resident_accelerator_experts_in_increasing_order():
    stay = check_plan(plan([4, 0, 2], [3], [2]), NEEDED, PRESENT, layer=0)
    assert stay.tolist() == [0, 4]
    stay = check_plan(LayerPlan(np.array([4, 0]), np.array([3, 2]), EMPTY), NEEDED, PRESENT, 0)
    assert stay.tolist() == [0, 4]


@pytest.mark.parametrize(
    "bad",
    [
        plan([0, 4], [2]),  # expert 3 computed nowhere
        plan([0, 4, 2], [2, 3], [2]),  # expert 2 computed twice
        plan([0, 4, 1], [2, 3]),  # expert 1 is not needed
        plan([0, 4], [2, 3, 6]),  # outside 0..5
        plan([0, 4], [2, 3, -1]),  # negative
    ],
)
def test_a_plan_that_does_not_compute_every_needed_expert_once_is_refused(bad):
    with pytest.raises(PlanError, match="layer 7"):
        check_plan(bad, NEEDED, PRESENT, layer=7)


@pytest.mark.parametrize(
    "bad",
    [
        plan([0, 4, 2], [3]),  # 2 on the accelerator, absent and not fetched
        plan([0, 4, 2], [3], [2, 0]),  # 0 fetched though cached
        plan([0, 4], [2, 3], [2]),  # a fetch computed on the CPU
    ],
)
def test_fetches_must_be_absent_accelerator_experts_and_the_rest_resident(bad):
    with pytest.raises(PlanError, match="fetches must be absent"):
        check_plan(bad, NEEDED, PRESENT, layer=0)
