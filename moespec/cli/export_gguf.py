"""Write a checkpoint as a GGUF file for llama.cpp: the same weights (f32, bf16 or Q8_0),
hyperparameters and tokenizer, so that llama.cpp tokenizes and decodes as moespec does.

Families: qwen3_moe, olmoe, qwen3, llama. Needs the optional extra (`pip install -e
'.[llamacpp]'`, for the `gguf` package). Q8_0 keeps routers, norms and rows not a multiple
of 32 at f32/bf16, as llama.cpp's own conversion does.
"""

import argparse
import json

from moespec.cli.options import checkpoint_dir

HELP = "write a checkpoint as GGUF (bf16, f32 or q8_0) for llama.cpp"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL_DIR", type=checkpoint_dir, help="checkpoint")
    parser.add_argument("out", metavar="OUT.gguf", help="the GGUF file to write")
    parser.add_argument(
        "--type",
        dest="weight_type",
        choices=("bf16", "f32", "q8_0"),
        default="bf16",
        help="weight type of the matrices (default bf16)",
    )
    parser.add_argument("--force", action="store_true", help="overwrite an existing OUT.gguf")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        from moespec.export.gguf import export_gguf
    except ImportError as error:
        raise ValueError(
            f"export-gguf needs the gguf package ({error}); pip install -e '.[llamacpp]'"
        ) from None
    summary = export_gguf(args.model, args.out, weight_type=args.weight_type, force=args.force)
    if args.json:
        print(json.dumps(summary))
        return 0
    kept = f", {len(summary['kept_bf16'])} tensors kept at bf16" if summary["kept_bf16"] else ""
    print(
        f"wrote {args.out}: {summary['architecture']} {summary['weight_type']}, "
        f"{summary['tensors']} tensors, {summary['bytes'] / 1e6:.1f} MB, "
        f"{summary['vocab_size']} tokens{kept}"
    )
    return 0
