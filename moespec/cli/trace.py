"""Record a routing trace: the experts every token of some documents selects, per MoE layer.

Runs the model teacher-forced over each document (a folder of text files, one document each,
a text file, or a JSONL file with one document per line), in chunks of --chunk-tokens tokens
with the KV cache carried across the chunks of a document, and writes one Parquet row per
(document, position, MoE layer) with the expert ids and gate weights (schema: see
moespec.routing.store). Only complete documents are written; on Ctrl-C the documents finished
so far are kept.
"""

import argparse
import sys

HELP = "record the routing of a model over documents into a Parquet trace"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory")
    parser.add_argument(
        "--corpus",
        required=True,
        nargs="+",
        metavar="PATH",
        help="folders of text files, text files, or JSONL files",
    )
    parser.add_argument("--out", required=True, metavar="FILE", help="trace file (.parquet)")
    parser.add_argument(
        "--max-tokens", type=int, metavar="N", help="stop after N tokens in all (default: all)"
    )
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument(
        "--chunk-tokens", type=int, default=512, metavar="N", help="tokens per pass (512)"
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
    from moespec.models import load_model
    from moespec.routing.corpus import read_corpus
    from moespec.routing.record import model_header, record_routing, tokenize_documents
    from moespec.routing.store import TraceWriter

    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.chunk_tokens < 1:
        raise ValueError(f"--chunk-tokens must be >= 1, got {args.chunk_tokens}")
    check_writable(args.out, force=args.force)
    # the whole corpus is read (and checked) before the model loads
    corpus = list(read_corpus(args.corpus, text_field=args.text_field, id_field=args.id_field))
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    documents = tokenize_documents(tokenizer, corpus, max_tokens=args.max_tokens)
    if not documents:
        raise ValueError("the corpus has no document with any tokens")
    header = model_header(
        model,
        {"corpus": list(args.corpus), "chunk_tokens": args.chunk_tokens},
    )
    total = sum(len(ids) for _, ids in documents)
    writer = TraceWriter(args.out, header, with_weights=True, force=args.force)
    try:
        with progress_bar(total) as advance, writer:
            for recorded in record_routing(
                model, documents, chunk_tokens=args.chunk_tokens, on_tokens=advance
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


def progress_bar(total: int, unit: str = "tokens"):
    """A context manager yielding advance(count): a transient rich progress bar on stderr."""
    import contextlib

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    @contextlib.contextmanager
    def bar():
        progress = Progress(
            BarColumn(),
            MofNCompleteColumn(),
            unit,
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        with progress:
            task = progress.add_task(unit, total=total)
            yield lambda count: progress.advance(task, count)

    return bar()
