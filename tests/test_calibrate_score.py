"""The scoring rules of seed 000 Table 8 on hand-made inputs."""

import numpy as np
import pytest

from moespec.calibrate.predict import Prediction
from moespec.calibrate.score import (
    measured_best,
    measured_crossover,
    measured_verify_times,
    paired_verify_times,
    round_paired,
    row_speedups,
    rule_best_draft_length,
    rule_crossover,
    rule_sign,
    rule_speedup,
    rule_verify_time,
    saving_interval,
    score,
)
from moespec.costmodel import best_draft_length, expected_tokens
from tests.plans import plan_around


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


# --- Table 8's thresholds, each pinned on both sides --------------------------------------


def test_crossover_rule_accepts_a_measured_crossover_at_n_max_for_a_predicted_none_only():
    assert rule_crossover(None, 9, 9)[0]
    assert not rule_crossover(9, None, 9)[0]  # the other way round is not in Table 8
    assert not rule_crossover(7, None, 9)[0]
    assert rule_crossover(3, 4, 9)[0] and rule_crossover(5, 4, 9)[0]
    assert not rule_crossover(2, 4, 9)[0] and not rule_crossover(6, 4, 9)[0]


def test_verify_time_rule_holds_at_15_percent_and_not_beyond():
    measured = {"slot": [1.0, 100.0], "dedup": [1.0, 100.0]}
    assert rule_verify_time({"slot": [1.0, 114.9], "dedup": [1.0, 100.0]}, measured)[0]
    assert not rule_verify_time({"slot": [1.0, 115.1], "dedup": [1.0, 100.0]}, measured)[0]
    assert not rule_verify_time({"slot": [1.0, 100.0], "dedup": [1.0, 84.9]}, measured)[0]


def sweep_with_best(best_by_acceptance, loss=0.1):
    """A sweep whose measured best draft length is given per acceptance; every other k is
    10% slower, and k = 2 (the prediction below) loses `loss` where it is not the best."""
    sweep = {}
    for a, best in best_by_acceptance.items():
        rates = {str(k): 90.0 for k in range(9)}
        rates[str(best)] = 100.0
        if best != 2:
            rates["2"] = 100.0 * (1 - loss)
        sweep[str(a)] = {"tokens_per_second": rates}
    return sweep


def test_best_draft_length_rule_needs_9_of_11_within_one():
    steps = [1.0, 1.0 + 1e-3, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]  # k_hat* = 1 at a >= 0.2
    acceptances = [0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98]
    nine = dict.fromkeys(acceptances[:9], 2) | dict.fromkeys(acceptances[9:], 5)
    eight = dict.fromkeys(acceptances[:8], 2) | dict.fromkeys(acceptances[8:], 5)
    assert rule_best_draft_length(steps, sweep_with_best(nine))[0] == (True, "9 of 11")
    assert rule_best_draft_length(steps, sweep_with_best(eight))[0] == (False, "8 of 11")


def test_throughput_loss_rule_holds_at_6_percent_and_not_beyond():
    steps = [1.0, 1.0 + 1e-3, 1.0 + 2e-3, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]  # k_hat* = 2
    assert best_draft_length(steps, 0.9) == 2
    assert rule_best_draft_length(steps, sweep_with_best({0.9: 5}, loss=0.059))[1][0]
    assert not rule_best_draft_length(steps, sweep_with_best({0.9: 5}, loss=0.061))[1][0]


def test_sign_rule_uses_a_95_percent_interval():
    # The saving's bootstrap distribution is mostly positive: a 50% interval excludes 0, the
    # 95% interval does not, so the rule must not check this n.
    # (3 of 9 slot samples below the dedup time: the median falls below it in ~15% of draws)
    samples = {("slot", 2): [1.0] * 3 + [1.3] * 6, ("dedup", 2): [1.2] * 9}
    low, high = saving_interval(samples[("slot", 2)], samples[("dedup", 2)], seed=2)
    assert low < 0 < high
    fifty = np.percentile(
        [
            np.median(np.random.default_rng(i).choice(samples[("slot", 2)], 7)) - 1.2
            for i in range(2000)
        ],
        [25, 75],
    )
    assert fifty[0] > 0  # a 50% interval would check it
    assert rule_sign([0.0, -1.0], samples, "dedup") == (True, "0 of 0")


def test_speedup_rule_fails_where_bound_21_is_undefined():
    holds, detail = rule_speedup([1.0, 1.5], {"0.9": {"tokens_per_second": {"0": 1, "1": 2}}}, 1.0)
    assert not holds and "undefined" in detail


# --- score() and the scoring script, end to end --------------------------------------------


def made_plan(verify_slot, verify_dedup, draft_time):
    prediction = Prediction(
        verify={"slot": np.array(verify_slot), "dedup": np.array(verify_dedup)},
        expert_time={"slot": np.array(verify_slot) / 2, "dedup": np.array(verify_dedup) / 2},
        bandwidth_error=0.02,
        draft_time=np.array(draft_time),
    )
    predictions = {version: prediction.to_dict() for version in VERSIONS}
    return plan_around(predictions, prediction.crossover(), draft_time)


VERSIONS = ("prediction", "measured_time", "calibrated")
SLOT = [1.0 + 0.3 * (n - 1) for n in range(1, 10)]  # ms, n = 1..9
DEDUP = [1.0 + 0.2 * (n - 1) + (0.25 if n <= 2 else 0.0) for n in range(1, 10)]  # faster from 3


def measured_run(slot, dedup, spread=0.01):
    """measure-verify records: 9 samples per kernel and n around the given times."""
    offsets = [spread * (i - 4) / 4 for i in range(9)]
    return [
        {"kernel": kernel, "n_tokens": n, "seconds": [t * (1 + o) for o in offsets]}
        for kernel, times in (("slot", slot), ("dedup", dedup))
        for n, t in enumerate(times, 1)
    ]


def oracle_sweep(step_times):
    """Tokens/s per acceptance and k from step times, as a perfect oracle sweep measures."""
    acceptances = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98)
    return {
        "step_times": list(step_times),
        "by_acceptance": {
            str(a): {
                "tokens_per_second": {
                    str(k): float(expected_tokens(a, k)) / step_times[k] for k in range(9)
                }
            }
            for a in acceptances
        },
    }


def test_score_passes_a_plan_that_predicts_its_runs_and_fails_one_that_does_not():
    plan = made_plan(SLOT, DEDUP, [0.0] * 9)
    truth = [min(s, d) for s, d in zip(SLOT, DEDUP, strict=True)]
    rules = score(plan, measured_run(SLOT, DEDUP), oracle_sweep(truth[:9]))
    assert all(holds for holds, _ in rules.values()), rules
    assert rules["crossover within one"][1] == "3 / 3"

    slow = [1.3 * t for t in SLOT]  # the engine is 30% slower than planned
    off = score(plan, measured_run(slow, [1.3 * t for t in DEDUP]), oracle_sweep(truth[:9]))
    assert not off["verify time within 15%"][0]
    assert off["verify time within 15%"][1] == "23.1%"  # 1 - 1/1.3 of the measured time


def test_scoring_script_writes_every_rule_and_the_noise_floor(tmp_path, capsys):
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "score_plan.py"

    plan = made_plan(SLOT, DEDUP, [0.0] * 9)
    truth = [min(s, d) for s, d in zip(SLOT, DEDUP, strict=True)]
    paths = {name: tmp_path / f"{name}.json" for name in ("plan", "verify", "sweep")}
    paths["plan"].write_text(json.dumps(plan.to_dict()))
    paths["verify"].write_text(json.dumps({"records": measured_run(SLOT, DEDUP)}))
    paths["sweep"].write_text(json.dumps(oracle_sweep(truth)))
    out = tmp_path / "score.json"
    argv = [str(paths[n]) for n in ("plan", "verify", "sweep")] + ["--out", str(out)]
    done = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert set(result) == {*VERSIONS, "noise_floor", "provenance"}
    assert all(rule["holds"] for rule in result["calibrated"].values())
    assert result["noise_floor"]["k* within one at >= 9 of 11"] == {
        "holds": True,
        "detail": "11 of 11",
    }
    assert "noise floor" in done.stdout


# --- round-paired measurements (the one-process evaluation) -------------------------------


def phased_records(times: dict, phases: list[float], noise=None):
    """Records of one round per phase multiplier: each (kernel, n) takes times[cell] x the
    round's multiplier (x its own noise factor, where given), rounds named out of order."""
    names = [f"verify {i % 3}/{i}" for i in range(len(phases))][::-1]
    records = []
    for cell, t in times.items():
        factors = noise[cell] if noise else [1.0] * len(phases)
        seconds = [t * m * f for m, f in zip(phases, factors, strict=True)][::-1]
        records.append({"kernel": cell[0], "n_tokens": cell[1], "seconds": seconds})
        records[-1]["rounds"] = names
    return records


def test_paired_verify_times_are_the_anchor_times_the_rounds_own_ratios():
    times = {("slot", 1): 1.0, ("slot", 2): 1.5, ("dedup", 1): 1.0, ("dedup", 2): 1.2}
    phases = [1.0, 2.0, 2.0, 1.0, 1.0]  # the machine's two speeds, round by round
    noise = {cell: [1.0, 1.0, 1.0, 1.0, 1.0] for cell in times}
    noise["slot", 2] = [1.0, 1.1, 0.9, 1.02, 1.0]
    by_cell = round_paired(phased_records(times, phases, noise))
    paired = paired_verify_times(by_cell)
    ref = [1.0, 2.0, 2.0, 1.0, 1.0]
    ratios = sorted(1.5 * m * f / r for m, f, r in zip(phases, noise["slot", 2], ref, strict=True))
    assert paired["slot", 1] == pytest.approx(1.0)  # median of the anchor's own samples
    assert paired["slot", 2] == pytest.approx(1.0 * ratios[2])  # x the median ratio
    assert paired["dedup", 2] == pytest.approx(1.2)


def test_round_pairing_takes_the_machines_phases_out_of_the_verify_rule():
    # Every pass 2x slower in 2 of 5 rounds; n = 2's median sample lands in the other phase
    # than n = 1's when one fast round of n = 2 is a little slow: the medians then disagree
    # by 2x on what the ratio tau(2) / tau(1) is, the rounds do not.
    times = {("slot", 1): 1.0, ("slot", 2): 1.5, ("dedup", 1): 1.0, ("dedup", 2): 1.5}
    phases = [1.0, 2.0, 1.0, 2.0, 1.0]
    noise = {cell: [1.0] * 5 for cell in times}
    noise["slot", 2] = [1.0, 1.0, 2.05, 1.0, 1.0]  # one fast round of slot n = 2 ran slowly
    records = phased_records(times, phases, noise)
    predicted = {"slot": [1.0, 1.5], "dedup": [1.0, 1.5]}
    assert measured_verify_times(records, "dedup", 2)["slot"] == pytest.approx([1.0, 1.5])
    unpaired = [{k: v for k, v in r.items() if k != "rounds"} for r in records]
    assert measured_verify_times(unpaired, "dedup", 2)["slot"] == pytest.approx([1.0, 3.0])
    assert rule_verify_time(predicted, measured_verify_times(records, "dedup", 2))[0]
    assert not rule_verify_time(predicted, measured_verify_times(unpaired, "dedup", 2))[0]


def test_round_pairing_refuses_records_of_other_rounds():
    times = {("slot", 1): 1.0, ("slot", 2): 1.5}
    records = phased_records(times, [1.0, 1.0, 1.0])
    records[1]["rounds"] = ["a", "b", "c"]
    with pytest.raises(ValueError, match=r"\('slot', 2\): timed in other rounds"):
        round_paired(records)
    records[1]["rounds"] = ["a"]
    with pytest.raises(ValueError, match=r"\('slot', 2\): 1 rounds for 3 samples"):
        round_paired(records)
    del records[1]["rounds"]
    assert round_paired(records) is None  # one record without rounds: medians for all


def test_sign_rule_on_rounds_checks_a_saving_the_phases_hide():
    # dedup saves 5% in every round; the rounds alternate between two speeds 2x apart, so
    # the two kernels' samples overlap and the unpaired interval spans 0
    times = {("slot", 1): 1.0, ("slot", 2): 1.0, ("dedup", 1): 1.0, ("dedup", 2): 0.95}
    records = phased_records(times, [1.0, 2.0] * 5)
    samples = {(r["kernel"], r["n_tokens"]): r["seconds"] for r in records}
    low, high = saving_interval(samples["slot", 2], samples["dedup", 2], seed=2)
    assert low < 0 < high
    assert rule_sign([0.0, 0.1], samples, "dedup") == (True, "0 of 0")
    paired = round_paired(records)
    assert rule_sign([0.0, 0.1], samples, "dedup", paired) == (True, "1 of 1")
    assert rule_sign([0.0, -0.1], samples, "dedup", paired) == (False, "0 of 1")


def test_sweep_rows_are_scored_by_their_paired_speedups_where_they_have_them():
    row = {
        "tokens_per_second": {"0": 10.0, "1": 12.0, "2": 13.0},  # k = 2's runs in a fast phase
        "paired_speedup": {
            "0": {"median": 1.0, "min": 1.0, "max": 1.0},
            "1": {"median": 1.25, "min": 1.2, "max": 1.3},
            "2": {"median": 1.1, "min": 1.0, "max": 1.4},
        },
    }
    assert row_speedups(row) == {0: 1.0, 1: 1.25, 2: 1.1}
    assert measured_best(row) == 1
    plain = {"tokens_per_second": row["tokens_per_second"]}
    assert row_speedups(plain) == {0: 1.0, 1: 1.2, 2: 1.3} and measured_best(plain) == 2
    steps = [1.0, 1.2, 10.0]  # k_hat* = 1 at a = 0.9
    assert rule_best_draft_length(steps, {"0.9": row}, 1) == ((True, "1 of 1"), (True, "0.0%"))
    loss = rule_best_draft_length(steps, {"0.9": plain}, 1)[1]
    assert loss == (False, f"{1 - 12 / 13:.1%}")
    # (21): the measured best speedup is the paired 1.25 (predicted 1.9 / 1.2 = 1.583)
    assert (
        rule_speedup(steps, {"0.9": row}, 0.12)[0]
        and not rule_speedup(steps, {"0.9": row}, 0.11)[0]
    )


def test_rescore_of_an_evaluation_with_its_own_plan_gives_its_own_scores():
    """benchmarks/rescore.py scores a plan against an evaluation run for another: given the
    evaluation's own plan it must reproduce the evaluation's rules for each of the plan's
    versions, detail for detail (the committed demo and OLMoE-4L fp32 scorecards)."""
    import json
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "benchmarks"))
    from rescore import rescore

    for config in ("demo-bf16", "olmoe4L-fp32"):
        folder = root / "benchmarks" / "results" / "scorecard" / config
        evaluation = json.loads((folder / "evaluation.json").read_text())
        scores = rescore(folder / "plan.json", folder)
        assert set(scores) == {"prediction", "measured_time", "calibrated"}
        for name, entry in scores.items():
            expected = evaluation["versions"][name]["score"]
            got = {rule: {"holds": h, "detail": d} for rule, (h, d) in entry["rules"].items()}
            assert got == expected, (config, name)


def test_rescore_refuses_a_plan_of_another_checkpoint(tmp_path):
    from pathlib import Path

    from tests.checkpoints import run_script

    root = Path(__file__).resolve().parent.parent
    results = root / "benchmarks" / "results" / "scorecard"
    done = run_script(
        root / "benchmarks" / "rescore.py",
        [str(results / "demo-bf16" / "plan.json"), str(results / "olmoe4L-fp32")],
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "ran olmoe-4L in fp32" in done.stderr
