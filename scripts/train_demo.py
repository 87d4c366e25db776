"""Train moespec's embedded demo models: a tiny Qwen3-MoE target and a dense Qwen3 draft.

Both models are trained from scratch on the running interpreter's own standard-library sources
(``*.py`` under ``sysconfig.get_paths()["stdlib"]``), so no download is needed, and share one
byte-level BPE tokenizer trained on the same text. Everything is seeded and the step counts
are fixed, so a rerun on the same machine and software writes byte-identical checkpoints.

Usage::

    python scripts/train_demo.py --out moespec/demo [--target-steps N] [--draft-steps N]
        [--seed S] [--force]

The output directory receives ``target/``, ``draft/`` (Hugging Face checkpoint folders with
bf16 ``model.safetensors``, tokenizer files and a model card) and ``training_log.json``. Other
files in it are left alone. The parts live in ``moespec/demo/training/`` (corpus, tokenizer,
model configs, training loop, measurement, cards), where ``tests/test_demo_training.py``
reruns a few steps; this file is the command line.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

# Idle OpenMP threads must sleep, not spin: on a shared 2-core machine a spinning thread steals
# the core its partner needs and a training step gets ~10x slower. libgomp reads this once, when
# torch loads it, so it has to be set before the first torch import; it does not change results.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import transformers  # noqa: E402

from moespec.demo.training import (  # noqa: E402
    OUTPUT_NAMES,
    deterministic_torch,
    install_outputs,
    train_and_evaluate,
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line flags."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="e.g. moespec/demo")
    ap.add_argument("--target-steps", type=int, default=800)
    ap.add_argument("--draft-steps", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--force", action="store_true", help="replace existing outputs")
    return ap.parse_args(argv)


def command_line(args: argparse.Namespace) -> str:
    """The flags that define the run. The output folder is left as ``OUT``: it does not affect
    the result, and the cards must not depend on it."""
    return (
        "python scripts/train_demo.py --out OUT --target-steps "
        f"{args.target_steps} --draft-steps {args.draft_steps} --seed {args.seed}"
        f" --batch-size {args.batch_size} --seq-len {args.seq_len}"
        f" --vocab-size {args.vocab_size} --threads {args.threads}"
    )


def run(args: argparse.Namespace) -> dict:
    """Train, save and evaluate into a staging folder, then rename the outputs into place."""
    wall = time.perf_counter()
    out: Path = args.out
    clash = [n for n in OUTPUT_NAMES if (out / n).exists()]
    if clash and not args.force:
        sys.exit(f"refusing to overwrite {', '.join(str(out / n) for n in clash)}; use --force")
    out.mkdir(parents=True, exist_ok=True)
    # staged next to the outputs so the final renames stay on one filesystem
    staging = Path(tempfile.mkdtemp(prefix=".train_demo-", dir=out))
    (staging / ".gitignore").write_text("*\n")  # keep a half-written run out of `git add`
    try:
        info = train_and_evaluate(args, staging, command_line(args))
        info["wall_seconds"] = round(time.perf_counter() - wall, 1)
        (staging / "training_log.json").write_text(json.dumps(info, indent=1) + "\n")
        install_outputs(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"wrote {', '.join(str(out / n) for n in OUTPUT_NAMES)} in {info['wall_seconds']}s")
    return info


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: parse flags, then train under fixed threads and deterministic kernels."""
    args = parse_args(argv)
    transformers.utils.logging.disable_progress_bar()
    with deterministic_torch(args.threads):
        run(args)


if __name__ == "__main__":
    main()
