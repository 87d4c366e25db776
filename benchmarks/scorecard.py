"""The seed-000 scorecard for one configuration: plan, then the one-process evaluation.

    python benchmarks/scorecard.py demo-bf16 --out benchmarks/results/scorecard/demo-bf16
    python benchmarks/scorecard.py olmoe4L-bf16 --out benchmarks/results/scorecard/olmoe4L-bf16
    python benchmarks/plan_table.py benchmarks/results/scorecard/*/

Makes the plan (`moespec plan`: benchmark, fits per layer, chain; resumed from bench.jsonl if
interrupted) unless OUT/plan.json exists (--force: makes it afresh), then runs `moespec
evaluate` on it in this process: verify phases and the oracle sweep interleaved on held-out
text, the chain anchored on this run's tau(1), the six rules per version and the noise floor.
Writes OUT/evaluation.json with the machine, versions and settings. Finished runs are
journaled in OUT/evaluation.jsonl until then: rerun without --force after an interruption and
the evaluation resumes from it (--force starts afresh).
"""

import argparse
import sys
from pathlib import Path

from moespec.bench.checkpoints import FULL_SIZE, random_checkpoint, streamed_random_checkpoint
from moespec.calibrate.evaluate import (
    CALIBRATIONS,
    CORRUPTIONS,
    EvaluationSettings,
    evaluate,
    journal_header,
    scorecard,
)
from moespec.calibrate.inprocess import TEXTS
from moespec.calibrate.plan import load_plan, make_plan
from moespec.calibrate.verify import STREAM_PASSES, VERIFY_MODES
from moespec.demo import demo_paths
from moespec.files import Journal, check_writable, write_json
from moespec.models import load_model
from moespec.progress import Progress

CONFIGS = {  # name: (checkpoint, dtype, weights)
    "demo-bf16": ("demo", "bf16", None),
    "olmoe4L-bf16": ("olmoe", "bf16", None),
    "olmoe4L-int8": ("olmoe", "bf16", "int8"),
    "olmoe4L-fp32": ("olmoe", "fp32", None),
    # full size: OLMoE-1B-7B's 16 layers of random weights, streamed (never whole in memory)
    "olmoe-1b-7b-bf16": ("olmoe-1b-7b", "bf16", None),
    "olmoe-1b-7b-int8": ("olmoe-1b-7b", "bf16", "int8"),
}


def checkpoint(kind: str, cache_dir: Path) -> Path:
    if kind == "demo":
        return demo_paths()[0]
    cache_dir.mkdir(parents=True, exist_ok=True)
    if kind in FULL_SIZE:
        return streamed_random_checkpoint(kind, cache_dir)
    return random_checkpoint(kind, cache_dir)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", choices=sorted(CONFIGS))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--verify-repeats", type=int, default=3)
    parser.add_argument("--sweep-order", choices=("blocks", "cells"), default="blocks")
    parser.add_argument("--corruption", choices=CORRUPTIONS, default="runner-up")
    parser.add_argument("--verify-mode", choices=VERIFY_MODES, default="stream")
    parser.add_argument("--stream-passes", type=int, default=STREAM_PASSES)
    parser.add_argument("--calibration", choices=CALIBRATIONS, default="here")
    parser.add_argument("--calibration-text", choices=TEXTS, default=TEXTS[0])
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--cache-dir", type=Path, default=Path("benchmarks/checkpoints"))
    parser.add_argument(
        "--force", action="store_true", help="make the plan afresh and overwrite evaluation.json"
    )
    args = parser.parse_args(argv)
    kind, dtype, weights = CONFIGS[args.config]
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    model_dir = checkpoint(kind, args.cache_dir)
    out = args.out / "evaluation.json"
    args.out.mkdir(parents=True, exist_ok=True)
    check_writable(out, force=args.force)
    if args.force or not (args.out / "plan.json").exists():
        from moespec.report.plan import write_report

        plan = make_plan(
            args.out, model_dir=model_dir, dtype=dtype, weights=weights, force=args.force
        )
        write_report(plan, args.out)
    plan = load_plan(args.out / "plan.json")
    model, tokenizer = load_model(model_dir, dtype=dtype, weights=weights)
    load_plan(args.out / "plan.json", model=model)  # this model's, weights kind and machine
    settings = EvaluationSettings(
        prompts=args.prompts,
        tokens=args.tokens,
        repeats=args.repeats,
        verify_repeats=args.verify_repeats,
        max_draft_length=len(plan.verify_time) - 1,
        sweep_order=args.sweep_order,
        corruption=args.corruption,
        verify_mode=args.verify_mode,
        stream_passes=args.stream_passes,
        calibration=args.calibration,
        calibration_text=args.calibration_text,
    )
    journal = Journal(
        args.out / "evaluation.jsonl", journal_header(plan, settings), restart=args.force
    )
    with Progress(True) as progress:
        result = evaluate(plan, model, tokenizer, settings, progress, journal)
    result.update(benchmark="scorecard", config=args.config)
    write_json(out, result, force=args.force)
    journal.remove()
    print(scorecard(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
