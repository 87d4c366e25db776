"""Write a checkpoint's weights once in the layouts moespec runs (the native pair layout, int8),
so that every later load maps them from the file instead of building them: ready to decode
in seconds, and processes running the same converted model share its pages.

    moespec convert MODEL_DIR OUT_DIR --weights int8
    moespec generate --model OUT_DIR "prompt"

Reads one layer at a time (the peak is one layer's source beside the layer being written);
writes OUT_DIR beside itself and renames it into place when complete (an interrupted or
failed run leaves nothing loadable). The layouts are this CPU's: a machine whose product
paths differ refuses the directory with the command that converts it again.
"""

import argparse
import json
import time

from moespec.cli.options import checkpoint_dir

HELP = "write a checkpoint in moespec's final layouts (bf16 pairs or int8), mapped by every load"
KINDS = ("bf16", "fp32", "int8", "int8-experts")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL_DIR", type=checkpoint_dir, help="checkpoint")
    parser.add_argument("out", metavar="OUT_DIR", help="the converted directory to write")
    parser.add_argument(
        "--weights",
        choices=KINDS,
        default="bf16",
        help="bf16 (default), fp32, int8 (experts, attention, dense MLPs and head; routers, "
        "norms and embeddings bf16) or int8-experts (the experts alone)",
    )
    parser.add_argument("--force", action="store_true", help="replace an existing OUT_DIR")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    from moespec.models.converted import convert
    from moespec.progress import Progress, show_progress

    start = time.perf_counter()
    with Progress(show_progress(quiet=args.json)) as progress:

        def advance(done: int, total: int) -> None:  # a part (embeddings, a layer) begins
            if done == 1:
                progress.start("converting", total=total, unit="parts")
            else:
                progress.advance(1)

        summary = convert(
            args.model, args.out, weights=args.weights, force=args.force, progress=advance
        )
    summary["seconds"] = round(time.perf_counter() - start, 2)
    if args.json:
        print(json.dumps(summary))
        return 0
    print(
        f"wrote {args.out}: {summary['weights']} weights, {summary['tensors']} tensors, "
        f"{summary['bytes'] / 1e9:.2f} GB in {summary['seconds']:.1f} s "
        f"(load it with --model {args.out})"
    )
    return 0
