"""Record a routing trace: the experts every token of some documents selects, per MoE layer.

Runs the model teacher-forced over each document (a folder of text files, one document each,
a text file, or a JSONL file with one document per line), in chunks of --chunk-tokens tokens
with the KV cache carried across the chunks of a document, and writes one Parquet row per
(document, position, MoE layer) with the expert ids and gate weights (schema: see
moespec.routing.store). Only complete documents are written; on Ctrl-C the documents finished
so far are kept. A document longer than the model's context is refused, or cut to its first
(--truncate right) or last (--truncate left) tokens that fit.
"""

import argparse
import sys

from moespec.cli.options import add_dtype, checkpoint_dir, positive_int

HELP = "record the routing of a model over documents into a Parquet trace"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        metavar="DIR",
        type=checkpoint_dir,
        help="checkpoint directory (default: the embedded demo MoE)",
    )
    parser.add_argument(
        "--corpus",
        required=True,
        nargs="+",
        action="extend",
        metavar="PATH",
        help="folders of text files, text files, or JSONL files (the flag may repeat)",
    )
    parser.add_argument("--out", required=True, metavar="FILE", help="trace file (.parquet)")
    parser.add_argument(
        "--max-tokens",
        type=positive_int,
        metavar="N",
        help="stop after N tokens in all (default: all)",
    )
    add_dtype(parser)
    parser.add_argument(
        "--chunk-tokens", type=positive_int, default=512, metavar="N", help="tokens per pass (512)"
    )
    parser.add_argument(
        "--truncate",
        default="none",
        choices=["none", "left", "right"],
        help="a document beyond the model's context: refuse it (none, the default), keep its "
        "first tokens that fit (right) or its last (left)",
    )
    parser.add_argument(
        "--text-field", default="text", metavar="NAME", help="JSONL field with the text"
    )
    parser.add_argument(
        "--id-field", default="id", metavar="NAME", help="JSONL field naming the document"
    )
    parser.add_argument("--force", action="store_true", help="overwrite an existing --out file")


def run(args: argparse.Namespace) -> int:
    from moespec.files import check_writable
    from moespec.progress import Progress, show_progress
    from moespec.routing.corpus import read_corpus

    check_writable(args.out, force=args.force)
    # the whole corpus is read (and checked) before torch and the model load
    corpus = list(read_corpus(args.corpus, text_field=args.text_field, id_field=args.id_field))
    from moespec.models import load_model
    from moespec.routing.record import (
        fit_documents,
        model_header,
        record_routing,
        tokenize_documents,
    )
    from moespec.routing.store import TraceWriter

    if args.model is None:
        from moespec.demo import demo_paths

        args.model = str(demo_paths()[0])
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    documents = tokenize_documents(tokenizer, corpus, max_tokens=args.max_tokens)
    if not documents:
        raise ValueError("the corpus has no document with any tokens")
    documents = fit_documents(documents, model.config, truncate=args.truncate)
    header = model_header(
        model,
        {"corpus": list(args.corpus), "chunk_tokens": args.chunk_tokens, "truncate": args.truncate},
    )
    total = sum(len(ids) for _, ids in documents)
    writer = TraceWriter(args.out, header, with_weights=True, force=args.force)
    try:
        with Progress(show_progress()) as progress, writer:
            progress.start("recording routing", total=total, unit="tokens")
            for recorded in record_routing(
                model, documents, chunk_tokens=args.chunk_tokens, on_tokens=progress.advance
            ):
                writer.add(recorded.name, recorded.expert_ids, recorded.gate_weights)
    except KeyboardInterrupt:
        if writer.names:
            print(
                f"interrupted: kept {len(writer.names)} complete documents "
                f"({writer.num_tokens} tokens) in {args.out}",
                file=sys.stderr,
            )
        else:
            print("interrupted before any document was complete: nothing written", file=sys.stderr)
        raise
    print(
        f"wrote {args.out}: {len(writer.names)} documents, {writer.num_tokens} tokens, "
        f"{header['num_layers']} MoE layers, {header['num_experts']} experts, "
        f"top-{header['top_k']}"
    )
    return 0
