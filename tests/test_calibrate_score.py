"""The scoring rules of seed 000 Table 8 on hand-made inputs."""

from moespec.calibrate.score import (
    measured_crossover,
    rule_best_draft_length,
    rule_crossover,
    rule_sign,
    rule_speedup,
    rule_verify_time,
)


def test_crossover_rule_counts_a_crossover_at_the_last_n_as_none():
    assert rule_crossover(4, 5, 9)[0] and not rule_crossover(4, 6, 9)[0]
    assert rule_crossover(None, None, 9)[0]
    assert rule_crossover(None, 9, 9)[0] and not rule_crossover(None, 8, 9)[0]
    assert measured_crossover([1, 2, 3, 4], [1, 2.1, 2.9, 3.5]) == 3


def test_sign_rule_checks_only_where_the_interval_excludes_zero():
    samples = {
        ("slot", 2): [2.0] * 9,
        ("dedup", 2): [1.0] * 9,  # clearly positive
        ("slot", 3): [1.0, 2.0] * 5,
        ("dedup", 3): [1.5] * 10,
    }  # interval spans 0
    assert rule_sign([0, 0.5, -1.0], samples, "dedup") == (True, "1 of 1")
    assert rule_sign([0, -0.5, 1.0], samples, "dedup") == (False, "0 of 1")


def test_verify_time_rule_is_the_worst_relative_error_from_n_2():
    measured = {"slot": [1.0, 2.0, 3.0], "dedup": [1.0, 2.0, 3.0]}
    predicted = {"slot": [9.0, 2.2, 3.0], "dedup": [1.0, 2.0, 2.7]}  # n = 1 ignored
    assert rule_verify_time(predicted, measured) == (True, "10.0%")
    predicted["dedup"][2] = 2.4
    assert rule_verify_time(predicted, measured)[0] is False


def test_best_draft_length_and_loss_rules():
    step_times = [1.0, 1.01, 1.02]  # nearly free drafts: k* = 2 at both acceptances
    sweep = {
        "0.9": {"tokens_per_second": {"0": 10.0, "1": 15.0, "2": 16.0}},
        "0.2": {"tokens_per_second": {"0": 10.0, "1": 9.0, "2": 8.0}},
    }
    (k_holds, k_detail), (loss_holds, loss_detail) = rule_best_draft_length(step_times, sweep, 2)
    assert k_detail == "1 of 2" and not k_holds  # at a = 0.2 k* = 2 but 0 is measured best
    assert loss_detail == "20.0%" and not loss_holds


def test_speedup_rule_uses_bound_21():
    step_times = [1.0, 1.5]
    sweep = {"0.9": {"tokens_per_second": {"0": 10.0, "1": 12.6}}}  # predicted 1.9/1.5=1.267
    assert rule_speedup(step_times, sweep, 0.01)[0]
    sweep["0.9"]["tokens_per_second"]["1"] = 10.5
    assert not rule_speedup(step_times, sweep, 0.01)[0]
