"""A plan's prediction scored against an evaluation that was run for another plan.

    python benchmarks/rescore.py NEW/plan.json benchmarks/results/scorecard/olmoe4L-fp32/

The evaluation's measurements (its verify records, sweep and noise floor) are kept; the new
plan's three versions are anchored on the evaluation's tau(1), as `moespec evaluate` anchors
its own plan's (eq. 22), and scored by the same six rules. Use it to ask whether a change to
how plans are made predicts a run that has already been measured, without measuring it again:
the plan must be of the same checkpoint and dtype, and it must not have seen the evaluation
(it is made from its own benchmark and passes, on documents the evaluation does not score).
Prints one row per version of the given plan, in the columns of `plan_table.py`.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from moespec.calibrate.predict import anchored_predictions
from moespec.calibrate.score import measured_crossover, measured_verify_times, score_prediction
from moespec.plan import load_plan

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_table import verify_error  # noqa: E402


def rescore(plan_path: Path, folder: Path) -> dict:
    """{version: {rules, verify_error, crossover}} of the plan at `plan_path` against the
    evaluation in `folder` (evaluation.json beside the plan it was run for)."""
    plan = load_plan(plan_path)
    if not (folder / "evaluation.json").is_file():
        raise ValueError(f"{folder} holds no evaluation.json (benchmarks/scorecard.py writes one)")
    evaluation = json.loads((folder / "evaluation.json").read_text())
    old = json.loads((folder / "plan.json").read_text())
    if (plan.model.name, plan.dtype) != (old["model"]["name"], old["dtype"]):
        raise ValueError(
            f"{plan_path} plans {plan.model.name} in {plan.dtype}; the evaluation in {folder} "
            f"ran {old['model']['name']} in {old['dtype']}"
        )
    dedup = plan.kernel.dedup_kernel
    records, sweep = evaluation["verify_records"], evaluation["sweep"]
    plain = statistics.median(
        next(r for r in records if (r["kernel"], r["n_tokens"]) == ("slot", 1))["seconds"]
    )
    max_n = max(r["n_tokens"] for r in records)
    versions = anchored_predictions(
        plan.chain,
        plain,
        bandwidth_error=plan.bandwidth_error,
        draft_time=np.zeros(max_n),  # the evaluation's oracle costs nothing
        dedup_kernel=dedup,
        step_kernel=dedup,
    )
    measured = measured_verify_times(records, dedup, max_n)
    out = {}
    for name, prediction in versions.items():
        rules = score_prediction(prediction, records, sweep, step_kernel=dedup)
        out[name] = {
            "rules": {rule: (bool(h), d) for rule, (h, d) in rules.items()},
            "verify_error": {
                k: verify_error(list(prediction.verify[k]), measured[k]) for k in ("slot", dedup)
            },
            "crossover": (
                prediction.crossover(),
                measured_crossover(measured["slot"], measured[dedup]),
            ),
            "epsilon": plan.bandwidth_error,
        }
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan", type=Path, help="the new plan.json")
    parser.add_argument("folder", type=Path, help="a scorecard folder with evaluation.json")
    args = parser.parse_args(argv)
    try:
        scores = rescore(args.plan, args.folder)
    except (OSError, ValueError, KeyError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    floor = json.loads((args.folder / "evaluation.json").read_text())["noise_floor"]
    noise = " / ".join(floor[rule]["detail"] for rule in floor)
    print("| version | crossover pred / meas | verify-time error slot / dedup | k* within one "
          "| largest loss | epsilon | Table-8 rules | noise floor (k*, loss) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, s in scores.items():
        rules = s["rules"]
        held = sum(h for h, _ in rules.values())
        errors = " / ".join(f"{e:.1%}" for e in s["verify_error"].values())
        print(
            f"| {name} (given plan) | {s['crossover'][0]} / {s['crossover'][1]} | {errors} "
            f"| {rules['k* within one at >= 9 of 11'][1]} | {rules['throughput lost <= 6%'][1]} "
            f"| {s['epsilon']:.3f} | {held} of {len(rules)} | {noise} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
