"""Benchmark: hot/cold accuracy of every reading of SpAc's utility estimator on real traces.

Real traces: held-out standard-library sources routed through the embedded demo target, with
rejected drafts routed as the demo draft's own proposals (benchmarks/demo_traces.py). Each
reading of `estimator.READINGS` (what Delta compares f with, fixed or adaptive boundaries)
drives SpAc through the simulator at draft length k and acceptance a; its forecast "hot = u >= 1"
is scored against the pass's active experts (seed 003 §4.3), beside the forecast "hot = active
in the previous pass" on the same passes. Beside them, the history ceiling at depths 1 to 3
(metrics.history_ceiling): the best any forecast from the last 1, 2 or 3 passes' counts could
score on those passes, chosen in hindsight, so how much room a longer memory than one pass has.
Accuracy does not depend on the hardware profile.

    python benchmarks/estimator_readings.py --out FILE [--documents 4] [--tokens 256]
"""

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_traces import demo_traces  # noqa: E402

from moespec.files import check_writable, write_json
from moespec.offload import get_profile, simulate
from moespec.offload.policies.estimator import READINGS
from moespec.offload.policies.spac import SpAcPolicy, reading_config
from moespec.offload.sim.metrics import history_ceiling
from moespec.offload.sim.simulator import SimulationSettings
from moespec.provenance import provenance  # noqa: E402


def main() -> int:
    args = parse_args()
    check_writable(args.out, force=args.force)
    traces = demo_traces(args.documents, args.tokens)
    profile = get_profile("rtx4090-pcie4")
    rows, ceilings = [], {}
    for k in args.draft_lengths:
        for reading in READINGS:
            rows.append(score(reading, k, traces, profile, args))
        ceilings[k] = ceiling(k, traces, profile, args)
    print_table(rows, ceilings)
    write_json(
        args.out,
        {
            "benchmark": "estimator readings: hot/cold accuracy on demo traces",
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "traces": [{"name": t.doc_names[0], "tokens": t.num_tokens} for t, _ in traces],
            "readings": {name: list(map(str, r)) for name, r in READINGS.items()},
            "results": rows,
            "history_ceiling": {str(k): c for k, c in ceilings.items()},
            "provenance": provenance(),
        },
        force=args.force,
    )
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def run(reading: str, k: int, trace, rejected, profile, args, record: bool = False):
    """SpAc with the estimator `reading` simulated on one trace (its first --fit-tokens fit)."""
    policy = SpAcPolicy(reading_config(reading), name=f"spac[{reading}]")
    policy.fit(trace.first_tokens(args.fit_tokens))
    settings = SimulationSettings(
        cache_ratio=args.expert_cache_ratio,
        draft_length=k,
        acceptance=args.acceptance,
        tokens=trace.num_tokens,
        fit_tokens=args.fit_tokens,
        seed=args.seed,
        record=record,
    )
    return simulate(trace, policy, profile, settings, rejected=rejected)


def score(reading: str, k: int, traces, profile, args) -> dict:
    """Mean accuracy over the traces (each: its first --fit-tokens the fit split)."""
    accuracy, previous = [], []
    for trace, rejected in traces:
        result = run(reading, k, trace, rejected, profile, args)
        accuracy.append(result.accuracy)
        previous.append(result.previous_pass_accuracy)
    return {
        "reading": reading,
        "draft_length": k,
        "hot_cold_accuracy": float(np.mean(accuracy)),
        "previous_pass_hot_cold_accuracy": float(np.mean(previous)),
        "per_trace": accuracy,
    }


def ceiling(k: int, traces, profile, args) -> dict:
    """Mean history ceiling over the traces at depths 1-3, on the passes `score` scores.

    The passes (accepted tokens, where a draft is rejected) come from the settings' seeded
    draws, not from the policy, so every reading is scored on these same passes.
    """
    out = {depth: [] for depth in (1, 2, 3)}
    for trace, rejected in traces:
        result = run("count-unit", k, trace, rejected, profile, args, record=True)
        counts = np.zeros((result.steps, trace.num_layers, trace.num_experts), dtype=np.int64)
        for entry in result.log["layers"]:
            counts[entry["step"], entry["layer"], entry["needed"]] = entry["counts"]
        for depth in out:
            out[depth].append(history_ceiling(counts, depth))
    return {f"depth_{d}": float(np.mean(v)) for d, v in out.items()}


def print_table(rows, ceilings) -> None:
    print(f"{'reading':<20} {'k':>3} {'acc':>7} {'prev-pass':>10} {'diff':>7}")
    for r in rows:
        acc, prev = r["hot_cold_accuracy"], r["previous_pass_hot_cold_accuracy"]
        name, k = r["reading"], r["draft_length"]
        print(f"{name:<20} {k:>3} {acc:>7.3f} {prev:>10.3f} {acc - prev:>+7.3f}")
    for k, c in ceilings.items():
        depths = ", ".join(f"{v:.3f} ({name.replace('_', ' ')})" for name, v in c.items())
        print(f"k = {k}: history ceiling (in hindsight) {depths}")


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
