"""Measure the whole model's verify time per kernel and pass size (no prediction involved).

A pass of n tokens (the text's next tokens, teacher forced) runs after a context of --depth
tokens of the embedded corpus (or --text FILE), is timed and rolled back; kernels and pass
sizes interleave within each repeat. Prints the median per (kernel, n) and the saving S(n).
"""

import argparse
import json

from moespec.cli.options import (
    add_batch_invariant,
    add_dtype,
    add_verify_mode,
    add_weights,
    checkpoint_dir,
    existing_file,
    positive_int,
    resolve_weights,
)

HELP = "measure whole-model verify time per kernel at n = 1..max-n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from moespec.calibrate.texts import VERIFY_TEXTS

    parser.add_argument(
        "--model", metavar="DIR", type=checkpoint_dir, help="checkpoint (default: the demo model)"
    )
    parser.add_argument(
        "--text",
        metavar="FILE",
        type=existing_file,
        help="text to verify (default: --verify-text's)",
    )
    parser.add_argument(
        "--verify-text",
        choices=VERIFY_TEXTS,
        default=VERIFY_TEXTS[0],
        help="without --text: the target's greedy continuation of a fit document's start, as "
        "`moespec plan` times by default, or the held-out test documents",
    )
    parser.add_argument("--kernels", default="slot,dedup")
    parser.add_argument("--max-n", type=positive_int, default=9)
    parser.add_argument(
        "--depth", type=positive_int, default=256, help="context tokens before the pass"
    )
    parser.add_argument("--repeats", type=positive_int, default=10)
    add_verify_mode(parser)
    add_batch_invariant(
        parser,
        "time the passes batch-invariant, as `moespec generate` verifies by default",
    )
    add_dtype(parser)
    add_weights(parser)
    parser.add_argument("--out", metavar="FILE.json", help="write every sample as JSON")
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from moespec.calibrate.verify import verify_run
    from moespec.files import check_writable, write_json
    from moespec.progress import Progress, show_progress

    if args.out:
        check_writable(args.out, force=args.force)
    model_dir = args.model or default_model()
    kernels = tuple(k.strip() for k in args.kernels.split(","))
    with Progress(show_progress(quiet=args.json)) as progress:
        result = verify_run(
            model_dir,
            text=args.text,
            dtype=args.dtype,
            weights=resolve_weights(args),
            kernels=kernels,
            max_n=args.max_n,
            depth=args.depth,
            repeats=args.repeats,
            mode=args.verify_mode,
            batch_invariant=args.batch_invariant == "on",
            verify_text_kind=args.verify_text,
            progress=progress,
        )
    if args.out:
        write_json(args.out, result, force=args.force)
    if args.json:
        print(json.dumps(result))
        return 0
    medians = {(r["kernel"], r["n_tokens"]): r["median"] for r in result["records"]}
    print(f"{'n':>3} " + " ".join(f"{k + ' (ms)':>14}" for k in kernels) + "   S(n) (ms)")
    for n in range(1, args.max_n + 1):
        row = [medians[(k, n)] * 1e3 for k in kernels]
        saving = row[0] - row[1] if len(row) > 1 else float("nan")
        print(f"{n:>3} " + " ".join(f"{v:>14.3f}" for v in row) + f"   {saving:>9.3f}")
    return 0


def default_model():
    from moespec.demo import demo_paths

    return demo_paths()[0]
