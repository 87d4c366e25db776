"""Write a synthetic routing trace, for model shapes we cannot run.

The routing process keeps each of the previous token's experts with probability p and draws
the rest from a skewed expert popularity (Zipf of exponent --skew, fixed per layer); p is
fitted so that the layer-mean rho(2) is --reuse2. --uniform writes independent uniform routing
instead. The shape is a built-in preset (--shape; its published rho(2) is the default target
where one was measured) or given by --layers, --experts, --top-k and --expert-bytes.
The file has the format `moespec trace` writes, without gate weights.
"""

import argparse

from moespec.cli.options import positive_int

HELP = "write a synthetic routing trace with a target reuse rho(2)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from moespec.routing.shapes import SHAPES

    parser.add_argument("--shape", choices=sorted(SHAPES), help="a built-in model shape")
    parser.add_argument(
        "--layers", type=positive_int, metavar="L", help="MoE layers (without --shape)"
    )
    parser.add_argument("--experts", type=positive_int, metavar="N", help="experts per layer")
    parser.add_argument("--top-k", type=positive_int, metavar="M", help="experts per token")
    parser.add_argument(
        "--expert-bytes",
        type=positive_int,
        metavar="B",
        help="bytes of one expert (without --shape)",
    )
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--reuse2", type=float, metavar="R", help="target layer-mean rho(2)")
    target.add_argument("--uniform", action="store_true", help="independent uniform routing")
    parser.add_argument(
        "--skew", type=float, default=0.5, help="Zipf exponent of expert popularity (0.5)"
    )
    parser.add_argument(
        "--tokens", type=positive_int, required=True, metavar="T", help="tokens in all"
    )
    parser.add_argument(
        "--documents", type=positive_int, default=1, metavar="D", help="documents (1)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, metavar="FILE", help="trace file (.parquet)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing --out file")


def resolve_shape(args: argparse.Namespace) -> dict:
    """{name, layers, experts, top_k, expert_bytes, layer_indices, published_reuse2}."""
    from moespec.routing.shapes import get_shape

    custom = [args.layers, args.experts, args.top_k, args.expert_bytes]
    if args.shape:
        if any(v is not None for v in custom):
            raise ValueError("--shape fixes the shape: drop --layers, --experts, --top-k, ...")
        shape = get_shape(args.shape)
        return {
            "name": shape.name,
            "layers": shape.num_layers,
            "experts": shape.num_experts,
            "top_k": shape.top_k,
            "expert_bytes": shape.expert_bytes,
            "layer_indices": list(shape.layer_indices),
            "published_reuse2": shape.published_reuse2,
        }
    flags = ("--layers", "--experts", "--top-k", "--expert-bytes")
    if any(v is None for v in custom):
        raise ValueError(f"give --shape NAME, or all of {', '.join(flags)}")
    for flag, value in zip(flags, custom, strict=True):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.top_k >= args.experts:
        raise ValueError(f"--top-k must be below --experts ({args.experts}), got {args.top_k}")
    return {
        "name": "synthetic",
        "layers": args.layers,
        "experts": args.experts,
        "top_k": args.top_k,
        "expert_bytes": [args.expert_bytes] * args.layers,
        "layer_indices": list(range(args.layers)),
        "published_reuse2": None,
    }


def run(args: argparse.Namespace) -> int:
    from moespec.files import check_writable
    from moespec.progress import Progress, show_progress
    from moespec.routing.store import TraceWriter
    from moespec.routing.synthetic import (
        LocalityProcess,
        document_lengths,
        document_names,
        uniform_process,
    )

    shape = resolve_shape(args)
    lengths = document_lengths(args.tokens, args.documents)
    check_writable(args.out, force=args.force)
    target = args.reuse2 if args.reuse2 is not None else shape["published_reuse2"]
    if args.uniform:
        process = uniform_process(shape["experts"], shape["top_k"])
    elif target is None:
        raise ValueError("give --reuse2 R (the target layer-mean rho(2)) or --uniform")
    else:
        process = LocalityProcess(shape["experts"], shape["top_k"], popularity_skew=args.skew)
        with Progress(show_progress()) as progress:
            progress.start(f"fitting the keep probability to rho(2) = {target}")
            process.fit(target, seed=args.seed)
    metadata = {**process.metadata(), "seed": args.seed}
    if not args.uniform:
        metadata["target_reuse2"] = target
    header = {
        "model": shape["name"],
        "num_layers": shape["layers"],
        "num_experts": shape["experts"],
        "top_k": shape["top_k"],
        "expert_bytes": shape["expert_bytes"],
        "layer_indices": shape["layer_indices"],
        "dtype": "",
        "metadata": metadata,
    }
    names = document_names(args.documents)
    writer = TraceWriter(args.out, header, with_weights=False, force=args.force)
    with Progress(show_progress()) as progress, writer:
        progress.start("writing synthetic routing", total=args.tokens, unit="tokens")
        documents = process.documents(shape["layers"], lengths, args.seed)
        for name, ids in zip(names, documents, strict=True):
            writer.add(name, ids)
            progress.advance(len(ids))
    fitted = "" if args.uniform else f", p = {process.p:.4f} (rho(2) {process.reuse2_:.3f})"
    print(
        f"wrote {args.out}: {shape['name']}, {args.documents} documents, {args.tokens} tokens"
        f"{fitted}"
    )
    return 0
