"""Score a plan against whole-model runs it never saw (seed 000 Table 8 rules).

    moespec plan --out plan-dir
    moespec measure-verify --out verify.json
    python benchmarks/speculative_sweep.py --model DIR --out sweep.json
    python benchmarks/score_plan.py plan-dir/plan.json verify.json sweep.json --out score.json

The rules are fixed in moespec/calibrate/score.py before any run is scored; each prints as
holds or fails, for each prediction version of the plan, and beside them the noise floor: the
k* and loss rules with k* from the sweep's own measured V(k).
"""

import argparse
import json
import sys
from pathlib import Path

from moespec.calibrate.score import noise_floor, score
from moespec.files import write_json
from moespec.plan import load_plan
from moespec.provenance import provenance


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan", type=Path)
    parser.add_argument("verify", type=Path, help="JSON written by moespec measure-verify --out")
    parser.add_argument("sweep", type=Path, help="JSON written by speculative_sweep.py")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    plan = load_plan(args.plan)
    verify = json.loads(args.verify.read_text())["records"]
    sweep = json.loads(args.sweep.read_text())
    results = {}
    for version in ("prediction", "measured_time", "calibrated"):
        if plan.predictions[version].staircase.error is not None:
            print(f"{version}: no valid step times")
            continue
        rules = score(plan, verify, sweep, version)
        results[version] = {
            name: {"holds": holds, "detail": detail} for name, (holds, detail) in rules.items()
        }
        print(f"{version}:")
        for name, (holds, detail) in rules.items():
            print(f"  {name:32s} {'holds' if holds else 'fails'}  ({detail})")
    floor = noise_floor(sweep)
    results["noise_floor"] = {
        name: {"holds": holds, "detail": detail} for name, (holds, detail) in floor.items()
    }
    print("noise floor (k* from the sweep's own measured V(k)):")
    for name, (holds, detail) in floor.items():
        print(f"  {name:32s} {'holds' if holds else 'fails'}  ({detail})")
    if args.out:
        inputs = {"plan": str(args.plan), "verify": str(args.verify), "sweep": str(args.sweep)}
        results["provenance"] = provenance(settings=inputs)
        write_json(args.out, results, force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
