"""The seed-000 Table 3/4 analogue for our engine, from scorecard folders.

    python benchmarks/plan_table.py benchmarks/results/plans/demo-bf16 ...

Each folder holds plan.json (`moespec plan`) and evaluation.json (`moespec evaluate` or
benchmarks/scorecard.py). Prints one Markdown row per folder and prediction version: the
crossover predicted / measured, the verify-time error per kernel (n >= 2), k* within one, the
largest throughput loss, epsilon, the rules held, and the noise floor of the two sweep rules.
Verify times are measured as the rules measure them (`moespec.calibrate.score.
measured_verify_times`: round by round where the evaluation recorded its rounds).
"""

import argparse
import json
import sys
from pathlib import Path

from moespec.calibrate.score import measured_crossover, measured_verify_times


def verify_error(predicted: list[float], measured: list[float]) -> float:
    return max(
        abs(p - m) / m
        for n, (p, m) in enumerate(zip(predicted, measured, strict=True), 1)
        if n >= 2
    )


def row(folder: Path) -> list[str]:
    plan = json.loads((folder / "plan.json").read_text())
    evaluation = json.loads((folder / "evaluation.json").read_text())
    dedup = plan["kernel"]["dedup_kernel"]
    records = evaluation["verify_records"]
    max_n = max(r["n_tokens"] for r in records)
    measured = measured_verify_times(records, dedup, max_n)
    crossover = measured_crossover(measured["slot"], measured[dedup])
    floor = evaluation["noise_floor"]
    noise = " / ".join(floor[rule]["detail"] for rule in floor)
    lines = []
    for version, entry in evaluation["versions"].items():
        prediction, rules = entry["prediction"], entry["score"]
        errors = [verify_error(prediction["verify_time"][k], measured[k]) for k in ("slot", dedup)]
        holds = sum(rule["holds"] for rule in rules.values())
        # a version of the calibration measured in the evaluation's process has its own epsilon
        epsilon = (
            evaluation["in_process"]["bandwidth_error"]
            if version.endswith("_here")
            else plan["bandwidth_error"]
        )
        lines.append(
            f"| {folder.name} | {version} | {prediction['crossover']} / {crossover} | "
            f"{errors[0]:.1%} / {errors[1]:.1%} | "
            f"{rules['k* within one at >= 9 of 11']['detail']} | "
            f"{rules['throughput lost <= 6%']['detail']} | {epsilon:.3f} | "
            f"{holds} of {len(rules)} | {noise} |"
        )
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    args = parser.parse_args(argv)
    print(
        "| config | version | crossover pred / meas | verify-time error slot / dedup | "
        "k* within one | largest loss | epsilon | Table-8 rules | noise floor (k*, loss) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for folder in args.folders:
        print("\n".join(row(folder)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
