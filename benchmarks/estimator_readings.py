"""Benchmark: hot/cold accuracy of every reading of SpAc's utility estimator on real traces.

Real traces: held-out standard-library sources routed through the embedded demo target, with
rejected drafts routed as the demo draft's own proposals (benchmarks/demo_traces.py). Each
reading of `estimator.READINGS` (what Delta compares f with, fixed or adaptive boundaries)
drives SpAc through the simulator at draft length k and acceptance a; its forecast "hot = u >= 1"
is scored against the pass's active experts (seed 003 §4.3), beside the forecast "hot = active
in the previous pass" on the same passes. Accuracy does not depend on the hardware profile.

    python benchmarks/estimator_readings.py --out FILE [--documents 4] [--tokens 256]
"""

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_traces import demo_traces  # noqa: E402

from moespec.files import check_writable, write_json
from moespec.offload import get_profile, simulate
from moespec.offload.policies.estimator import READINGS
from moespec.offload.policies.spac import SpAcPolicy, reading_config
from moespec.offload.sim.simulator import SimulationSettings
from moespec.provenance import provenance  # noqa: E402


def main() -> int:
    args = parse_args()
    check_writable(args.out, force=args.force)
    traces = demo_traces(args.documents, args.tokens)
    profile = get_profile("rtx4090-pcie4")
    rows = []
    for k in args.draft_lengths:
        for reading in READINGS:
            rows.append(score(reading, k, traces, profile, args))
    print_table(rows)
    write_json(
        args.out,
        {
            "benchmark": "estimator readings: hot/cold accuracy on demo traces",
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "traces": [{"name": t.doc_names[0], "tokens": t.num_tokens} for t, _ in traces],
            "readings": {name: list(map(str, r)) for name, r in READINGS.items()},
            "results": rows,
            "provenance": provenance(),
        },
        force=args.force,
    )
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def score(reading: str, k: int, traces, profile, args) -> dict:
    """Mean accuracy over the traces (each: its first --fit-tokens the fit split)."""
    accuracy, previous = [], []
    for trace, rejected in traces:
        settings = SimulationSettings(
            cache_ratio=args.expert_cache_ratio,
            draft_length=k,
            acceptance=args.acceptance,
            tokens=trace.num_tokens,
            fit_tokens=args.fit_tokens,
            seed=args.seed,
        )
        policy = SpAcPolicy(reading_config(reading), name=f"spac[{reading}]")
        policy.fit(trace.first_tokens(args.fit_tokens))
        result = simulate(trace, policy, profile, replace(settings), rejected=rejected)
        accuracy.append(result.accuracy)
        previous.append(result.previous_pass_accuracy)
    return {
        "reading": reading,
        "draft_length": k,
        "hot_cold_accuracy": float(np.mean(accuracy)),
        "previous_pass_hot_cold_accuracy": float(np.mean(previous)),
        "per_trace": accuracy,
    }


def print_table(rows) -> None:
    print(f"{'reading':<20} {'k':>3} {'acc':>7} {'prev-pass':>10} {'diff':>7}")
    for r in rows:
        acc, prev = r["hot_cold_accuracy"], r["previous_pass_hot_cold_accuracy"]
        name, k = r["reading"], r["draft_length"]
        print(f"{name:<20} {k:>3} {acc:>7.3f} {prev:>10.3f} {acc - prev:>+7.3f}")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="results JSON")
    parser.add_argument("--documents", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--fit-tokens", type=int, default=32)
    parser.add_argument("--draft-lengths", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--acceptance", type=float, default=0.7)
    parser.add_argument("--expert-cache-ratio", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true")
    return parser.parse_args()


if __name__ == "__main__":
    raise SystemExit(main())
