"""The seed-000 Table 3/4 analogue for our engine, from plan, verify and sweep result files.

    python benchmarks/plan_table.py benchmarks/results/plans/demo-bf16 ...

Each folder holds plan.json (`moespec plan`), verify.json (`moespec measure-verify --out`),
sweep.json (speculative_sweep.py) and score.json (score_plan.py). Prints one Markdown row per
folder and prediction version.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

from moespec.calibrate.score import measured_crossover, rule_best_draft_length
from moespec.plan import load_plan


def row(folder: Path) -> list[str]:
    plan = load_plan(folder / "plan.json")
    verify = json.loads((folder / "verify.json").read_text())["records"]
    sweep = json.loads((folder / "sweep.json").read_text())["by_acceptance"]
    score = json.loads((folder / "score.json").read_text())
    dedup = plan.kernel.dedup_kernel
    max_n = len(plan.predictions["calibrated"].saving)
    measured = {
        k: [
            statistics.median(r["seconds"])
            for r in sorted((r for r in verify if r["kernel"] == k), key=lambda r: r["n_tokens"])
        ]
        for k in ("slot", dedup)
    }
    crossover = measured_crossover(measured["slot"], measured[dedup])
    r = plan.bandwidth_ratio[dedup]
    u = plan.routing.byte_share
    big = min(8, max_n)
    lines = []
    for version, rules in score.items():
        prediction = plan.predictions[version]
        error = max(
            abs(p - m) / m
            for k in ("slot", dedup)
            for n, (p, m) in enumerate(zip(prediction.verify_time[k], measured[k], strict=True), 1)
            if n >= 2
        )
        (_, within), (_, lost) = rule_best_draft_length(prediction.staircase.step_times, sweep)
        holds = sum(rule["holds"] for rule in rules.values())
        lines.append(
            f"| {folder.name} | {version} | {prediction.crossover} / {crossover} | "
            f"{r[2]:.2f} / {u[1]:.2f} | {r[big]:.2f} / {u[big - 1]:.2f} | "
            f"{error:.1%} | {within} | {lost} | {plan.bandwidth_error:.3f} | "
            f"{holds} of {len(rules)} |"
        )
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    args = parser.parse_args(argv)
    print(
        "| config | version | crossover pred / meas | r(2) / u(2) | r(8) / u(8) | "
        "verify-time error | k* within one | largest loss | epsilon | Table-8 rules |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for folder in args.folders:
        print("\n".join(row(folder)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
