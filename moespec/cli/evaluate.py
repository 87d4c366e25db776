"""Score a plan on this machine in one process: whole-model verify times of both kernels and the
oracle-draft sweep (k = 0..8 x 11 acceptances), interleaved on the same token stream; the
plan's prediction anchored on this run's tau(1); seed 000's six Table-8 rules for each of its
versions, with the noise floor (the rules for k* taken from the sweep's own measured V(k)).

    moespec plan --out plan-dir
    moespec evaluate plan-dir --out plan-dir/evaluation.json
"""

import argparse
import json
from pathlib import Path

from moespec.cli.options import add_verify_mode, checkpoint_dir, positive_int

HELP = "score a plan: verify times and the speculative sweep, interleaved in one process"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="PLAN", help="plan directory or plan.json")
    parser.add_argument(
        "--model", metavar="DIR", type=checkpoint_dir, help="checkpoint (default: the plan's)"
    )
    parser.add_argument("--prompts", type=positive_int, default=6, help="held-out prompts")
    parser.add_argument("--prompt-tokens", type=positive_int, default=64)
    parser.add_argument("--tokens", type=positive_int, default=256, help="tokens per run")
    parser.add_argument("--repeats", type=positive_int, default=3, help="runs per prompt and cell")
    parser.add_argument("--verify-repeats", type=positive_int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sweep-order",
        choices=("blocks", "cells"),
        default="blocks",
        help="blocks: each (acceptance, prompt)'s draft lengths back to back (default); "
        "cells: whole (acceptance, k) cells in a random order",
    )
    parser.add_argument(
        "--corruption",
        choices=("runner-up", "uniform"),  # calibrate.evaluate.CORRUPTIONS (imported lazily)
        default="runner-up",
        help="what a wrong draft proposes: the target's best token other than the greedy one "
        "(default), or a token drawn from the whole vocabulary",
    )
    add_verify_mode(parser)
    parser.add_argument(
        "--stream-passes",
        type=positive_int,
        default=6,  # calibrate.verify.STREAM_PASSES
        help="timed passes per value in --verify-mode stream (after one untimed)",
    )
    parser.add_argument(
        "--calibration",
        choices=("here", "plan"),  # calibrate.evaluate.CALIBRATIONS (imported lazily)
        default="here",
        help="here: also measure the plan's calibration again in this process, a share before "
        "each verify phase, and score its versions beside the plan's (default); plan: the "
        "plan's versions only",
    )
    parser.add_argument(
        "--calibration-text",
        choices=("continuations", "documents"),  # calibrate.inprocess.TEXTS
        default="continuations",
        help="what the in-process calibration's whole-model passes run on: the target's greedy "
        "continuations of fit-document prompts (default), or the plan's verify text",
    )
    parser.add_argument("--out", metavar="FILE.json", required=True)
    parser.add_argument("--force", action="store_true", help="overwrite an existing --out")
    parser.add_argument("--json", action="store_true", help="print the evaluation as JSON")


def plan_model_dir(plan: dict, path: Path) -> Path:
    """The checkpoint a plan was made for: the demo pair by name, else its recorded path."""
    from moespec.demo import DEMO_DIR

    recorded = plan.model_dir or ""
    if recorded.startswith("moespec/demo/"):
        return Path(DEMO_DIR) / recorded.removeprefix("moespec/demo/")
    if recorded and Path(recorded).is_dir():
        return Path(recorded)
    raise ValueError(f"{path}: its model {recorded!r} is not here; pass --model DIR")


def run(args: argparse.Namespace) -> int:
    from moespec.calibrate.evaluate import (
        EvaluationSettings,
        evaluate,
        journal_header,
        scorecard,
    )
    from moespec.calibrate.plan import load_plan
    from moespec.files import Journal, check_writable, write_json
    from moespec.models import load_model
    from moespec.progress import Progress, show_progress

    check_writable(args.out, force=args.force)
    path = Path(args.plan)
    path = path / "plan.json" if path.is_dir() else path
    plan = load_plan(path)
    settings = EvaluationSettings(
        prompts=args.prompts,
        prompt_tokens=args.prompt_tokens,
        tokens=args.tokens,
        repeats=args.repeats,
        verify_repeats=args.verify_repeats,
        max_draft_length=len(plan.verify_time) - 1,
        seed=args.seed,
        sweep_order=args.sweep_order,
        corruption=args.corruption,
        verify_mode=args.verify_mode,
        stream_passes=args.stream_passes,
        calibration=args.calibration,
        calibration_text=args.calibration_text,
    )
    model_dir = Path(args.model) if args.model else plan_model_dir(plan, path)
    model, tokenizer = load_model(model_dir, dtype=plan.dtype)
    load_plan(path, model.config)  # the plan must be this model's
    # finished runs go to OUT.jsonl as they finish: a rerun after an interruption resumes
    journal = Journal(
        Path(args.out).with_suffix(".jsonl"), journal_header(plan, settings), restart=args.force
    )
    with Progress(show_progress(quiet=args.json)) as progress:
        result = evaluate(plan, model, tokenizer, settings, progress, journal)
    result["plan"] = str(path)
    write_json(args.out, result, force=args.force)
    journal.remove()
    if args.json:
        print(json.dumps(result))
        return 0
    print(scorecard(result))
    return 0
