"""Serve a model over HTTP with the OpenAI API, speculating per request.

POST /v1/completions and /v1/chat/completions (with "stream": true as server-sent events),
GET /v1/models, /health, /metrics (Prometheus text). Batch size 1: requests wait in a queue of
--max-queue; a full queue answers 429 with Retry-After. Each request decodes through the same
loop as `moespec generate`: drafted by --draft (default: auto with the demo draft for the demo
model: per step the suffix drafter, the draft model or none; else none), the draft length
chosen by --draft-length (default auto: k*(a) from the cost model), the expert kernel by
--kernel, its verification passes batch-invariant (greedy answers equal plain greedy decoding
in bf16; a seeded sample equals the plain sample of that seed). Bodies over
--max-request-bytes answer 413 unread; prompts over --max-prompt-tokens answer 400.
Listens on loopback unless --host says otherwise.

With --offload POLICY the target's experts are offloaded as `moespec generate` offloads them
(the same policies, --expert-cache-ratio/--expert-cache-bytes, --offload-device, and
--memory-budget SIZE|auto for a converted model's experts read from disk into a RAM cache), by
one offload engine for the server's life, closed at shutdown; requests decode one at a time
(--max-batch 1: the batched pass does not run offloaded experts), and /metrics adds its hit
rate, bytes read and stall seconds.
Needs the optional dependencies: pip install 'moespec[serve]'.
"""

import argparse
import importlib.util
import sys

from moespec.cli.generate import parse_draft_length
from moespec.cli.options import add_offload, offload_settings

HELP = "serve the model with an OpenAI-compatible HTTP API (speculative decoding per request)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        metavar="DIR",
        help="checkpoint directory (default: the embedded demo MoE, drafted by its demo draft)",
    )
    parser.add_argument(
        "--draft",
        metavar="auto|auto:DIR|DIR|suffix[:CORPUS]|lookup|oracle:A|none",
        help="draft: auto chooses per step among the suffix drafter, the draft model DIR of "
        "auto:DIR, and none; or one drafter: a checkpoint sharing the tokenizer, "
        "the suffix drafter (over the prompt, the output and CORPUS files, separated by ':'), "
        "prompt lookup, the oracle at acceptance A (greedy requests only); or none (default: "
        "auto with the demo draft for the demo model, else none)",
    )
    parser.add_argument("--draft-length", default="auto", metavar="K|auto")
    parser.add_argument("--max-draft-length", type=int, default=8, metavar="K")
    parser.add_argument(
        "--kernel",
        default="auto",
        choices=["auto", "slot", "dedup", "dedup-linear", "reference"],
        help="expert kernel of each pass (default: auto)",
    )
    parser.add_argument("--crossover", type=int, metavar="N")
    parser.add_argument(
        "--plan", metavar="FILE", help="plan.json from `moespec plan` (crossover and V(k))"
    )
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback)")
    parser.add_argument("--port", type=int, default=8000, help="port (0: a free one)")
    parser.add_argument(
        "--max-queue", type=int, default=16, metavar="N", help="requests that may wait (16)"
    )
    parser.add_argument(
        "--max-tokens-limit",
        type=int,
        default=1024,
        metavar="N",
        help="the most max_tokens a request may ask for (1024)",
    )
    parser.add_argument(
        "--max-batch",
        type=int,
        default=1,
        metavar="N",
        help="requests decoded together, one pass per step for all (continuous batching: "
        "a finished request leaves and a waiting one joins between steps; default 1)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=4 * 2**20,
        metavar="N",
        help="the largest request body taken, in bytes; larger ones answer 413 (4 MiB)",
    )
    parser.add_argument(
        "--max-prompt-tokens",
        type=int,
        metavar="N",
        help="the longest prompt taken, in tokens (default: the model's context length)",
    )
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="neither read nor write the measurements earlier runs remembered",
    )
    add_offload(parser)


def run(args: argparse.Namespace) -> int:
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"needs {' and '.join(missing)}: pip install 'moespec[serve]'")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    from moespec.errors import cli_text
    from moespec.serve import serve

    def listening(url, engine):
        name = f"{engine.model_name} (draft {engine.speculation.name})"
        if engine.offload is not None:
            name += f", experts offloaded by {engine.offload.describe()}"
        print(f"moespec serve: {name} on {url}", flush=True)

    serve(
        args.host,
        args.port,
        listening,
        model=args.model,
        draft=args.draft,
        draft_length=parse_draft_length(args.draft_length),
        max_draft_length=args.max_draft_length,
        kernel=args.kernel,
        crossover=args.crossover,
        plan=args.plan,
        dtype=args.dtype,
        max_queue=args.max_queue,
        max_tokens_limit=args.max_tokens_limit,
        max_request_bytes=args.max_request_bytes,
        max_prompt_tokens=args.max_prompt_tokens,
        max_batch=args.max_batch,
        remember=not args.no_cache,
        offload_settings=offload_settings(args),
        on_note=lambda line: print(cli_text(line), file=sys.stderr, flush=True),
    )
    return 0
