"""Generate text with an MoE model, streaming it as it is decoded.

Loads a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json) and
decodes at batch size 1. The expert kernel of each pass is chosen by --kernel: "slot"
(per-slot), "dedup" (deduplicating), or "auto" (per-slot below --crossover, deduplicating
from it). Temperature 0 is greedy.
"""

import argparse
import json
import sys

HELP = "generate text (streamed), with the expert kernel chosen per pass"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory")
    parser.add_argument("--max-tokens", type=int, default=128, metavar="N")
    parser.add_argument(
        "--kernel",
        default="auto",
        choices=["auto", "slot", "dedup", "dedup-linear", "reference"],
        help="expert kernel of each pass (default: auto)",
    )
    parser.add_argument(
        "--crossover", type=int, metavar="N", help="with --kernel auto: deduplicate from n = N"
    )
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")


def run(args: argparse.Namespace) -> int:
    import torch

    from moespec.decoding import KernelPolicy, Sampler, generate, summarize
    from moespec.models import StreamingDetokenizer, load_model

    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    kernels = KernelPolicy(args.kernel, args.crossover)
    sampler = Sampler(args.temperature, args.top_p, args.seed)
    torch.manual_seed(args.seed)
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    prompt = tokenizer.encode(args.prompt)
    if not prompt:
        raise ValueError("the prompt encodes to no tokens")
    stream = StreamingDetokenizer(tokenizer)
    records = []
    for record in generate(
        model,
        prompt,
        max_tokens=args.max_tokens,
        sampler=sampler,
        kernels=kernels,
        stop_tokens=model.config.eos_token_ids,
    ):
        records.append(record)
        piece = stream.add(record.tokens)
        if not args.json:
            print(piece, end="", flush=True)
    tokens = [t for r in records for t in r.tokens]
    summary = summarize(records)
    if args.json:
        print(
            json.dumps(
                {
                    "model": str(args.model),
                    "prompt": args.prompt,
                    "prompt_tokens": prompt,
                    "tokens": tokens,
                    "text": tokenizer.decode(tokens),
                    **summary,
                    "steps": [r.to_dict() for r in records],
                }
            )
        )
    else:
        print(stream.flush())
        rate = summary["tokens_per_second"]
        rate_text = f"{rate:.1f} tokens/s" if rate else "n/a tokens/s"
        print(
            f"[{len(tokens)} tokens, {rate_text} decode, prompt {len(prompt)} tokens in "
            f"{summary['prefill_seconds']:.2f} s]",
            file=sys.stderr,
        )
    return 0
