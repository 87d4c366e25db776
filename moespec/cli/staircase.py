"""The best draft length k*(a) as a staircase in the acceptance a, from a step-time table.

Given V(0), ..., V(k_max) (the time of a step that drafts k tokens and verifies k + 1), prints
the step points a_1..a_kmax (the acceptance rates at which the best draft length steps up by
one), the first-draft threshold a_0 (below it, drafting does not pay), and for each acceptance
the best draft length k*(a) with its speedup over plain decoding. Exact arithmetic: numbers
are read as decimals or fractions (e.g. 13/20) and computed as fractions.

Without --step-times it uses a built-in example: a deduplicating engine on OLMoE-1B-7B's byte
counts (16 layers, 64 experts of 12.6 MB in bf16, top-8, 1 GB of dense weights), independent
uniform routing and one bandwidth of 500 GB/s.
"""

import argparse
import json
from fractions import Fraction

HELP = "best draft length per acceptance (the staircase) from step times"

# Seed 000 runs an 11-value acceptance grid from 0.2 to 0.98; this is our reading of it.
DEFAULT_ACCEPTANCES = [
    "0.2",
    "0.3",
    "0.4",
    "0.5",
    "0.6",
    "0.7",
    "0.8",
    "0.85",
    "0.9",
    "0.95",
    "0.98",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--step-times",
        metavar="V0,V1,...",
        help="comma-separated step times V(0)..V(k_max), any unit (default: built-in example)",
    )
    parser.add_argument(
        "--acceptance",
        nargs="+",
        action="extend",
        metavar="A",
        help="acceptance rates in [0, 1), as a list or a repeated flag (default: 11 values "
        "from 0.2 to 0.98)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the staircase to a PNG file")
    parser.add_argument("--force", action="store_true", help="overwrite an existing --plot file")


def parse_number(text: str, what: str) -> Fraction:
    """A decimal or a fraction, exactly: '0.85' -> 17/20, '13/20' -> 13/20."""
    try:
        value = Fraction(text.strip())
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"{what}: {text!r} is not a number") from None
    return value


def parse_step_times(text: str) -> list[Fraction]:
    parts = [part for part in text.split(",") if part.strip()]
    values = [parse_number(part, "--step-times") for part in parts]
    if len(values) < 2:
        raise ValueError(f"--step-times needs at least two values V(0),V(1), got {len(values)}")
    for k, v in enumerate(values):
        if v <= 0:
            raise ValueError(f"--step-times: V({k}) = {parts[k].strip()} is not positive")
    return values


def example_step_times(max_draft_length: int = 8) -> list[Fraction]:
    """V(k) = tau_dedup(k+1), eq. (5), with one bandwidth: (D + sum_l w_l U_l(k+1)) / beta."""
    from moespec.costmodel import uniform_union, verify_time

    layers, experts, top_k = 16, 64, 8
    expert_bytes = 3 * 2048 * 1024 * 2  # gate, up, down of hidden 2048 x intermediate 1024, bf16
    dense_bytes, bandwidth = 10**9, 500 * 10**9
    return [
        verify_time(
            layers * expert_bytes * uniform_union(experts, top_k, k + 1),
            bandwidth,
            pass_dense_bytes=dense_bytes,
            dense_bandwidth=bandwidth,
        )
        * 1000  # milliseconds
        for k in range(max_draft_length + 1)
    ]


def staircase_table(step_times, acceptances: dict[str, Fraction]) -> dict:
    """Everything the command prints, as plain floats keyed by the acceptances as written."""
    from moespec.costmodel import best_draft_length, first_draft_threshold, speedup, step_points

    best = {text: best_draft_length(step_times, a) for text, a in acceptances.items()}
    return {
        "step_times": [float(v) for v in step_times],
        "step_points": [float(p) for p in step_points(step_times)],
        "first_draft_threshold": float(first_draft_threshold(step_times)),
        "best_draft_length": best,
        "speedup": {
            text: float(speedup(step_times, a, best[text])) for text, a in acceptances.items()
        },
    }


def run(args: argparse.Namespace) -> int:
    from moespec.files import check_writable

    given = args.step_times is not None
    step_times = parse_step_times(args.step_times) if given else example_step_times()
    acceptances = {}
    for text in args.acceptance or DEFAULT_ACCEPTANCES:
        a = parse_number(text, "--acceptance")
        if not 0 <= a < 1:
            raise ValueError(f"--acceptance: {text} is not in [0, 1)")
        acceptances[text] = a
    if args.plot:
        check_writable(args.plot, force=args.force)
    table = staircase_table(step_times, acceptances)
    if args.json:
        print(json.dumps(table, indent=2))
    else:
        print(format_table(table, example=not given))
    if args.plot:
        from moespec.report.staircase import plot_staircase

        plot_staircase(step_times, args.plot, force=args.force)
        if not args.json:
            print(f"wrote {args.plot}")
    return 0


def format_table(table: dict, *, example: bool) -> str:
    lines = []
    if example:
        lines.append("built-in example: deduplicating engine, OLMoE-1B-7B bytes, uniform routing")
    lines.append("step times V(k): " + " ".join(f"{v:.4g}" for v in table["step_times"]))
    lines.append(f"first-draft threshold a0 = {table['first_draft_threshold']:.6f}")
    lines.append(
        "step points: "
        + "  ".join(f"a{j}={p:.6f}" for j, p in enumerate(table["step_points"], start=1))
    )
    lines.append(f"{'acceptance':>10}  {'best k':>6}  {'speedup':>8}")
    for text, k in table["best_draft_length"].items():
        lines.append(f"{text:>10}  {k:>6}  {table['speedup'][text]:>8.4f}")
    return "\n".join(lines)
