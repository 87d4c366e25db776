"""Speculative decoding with a draft model: moespec against transformers' assisted generation,
the same target and draft checkpoints and the same draft length k, side by side in one run.

    python benchmarks/assisted_vs_transformers.py --out benchmarks/results/assisted_demo.json

Defaults to the embedded demo pair. transformers drafts exactly k tokens per step only with the
draft's `generation_config.num_assistant_tokens = k` and `assistant_confidence_threshold = 0`
(else it drafts fewer, adaptively); both run greedy, bf16, batch 1. Reports decode tokens/s
(time of N + 1 tokens minus time of 1), plain decoding of each engine, and whether the two
engines' tokens agree.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moespec.decoding import DraftLengthPolicy, KernelPolicy, ModelDrafter, Sampler  # noqa: E402
from moespec.decoding import generate as moespec_generate  # noqa: E402
from moespec.demo import describe  # noqa: E402
from moespec.files import write_json  # noqa: E402
from moespec.models import load_model  # noqa: E402
from moespec.provenance import provenance  # noqa: E402

PROMPTS = [
    "def fibonacci(n):",
    "class LRUCache:\n    def __init__(self, capacity):",
    "import os\n\ndef walk_files(root):",
]


def moespec_runner(target, draft, prompt, k):
    def run(n):
        drafter = ModelDrafter(draft, Sampler(), target.config.vocab_size) if k else None
        policy = DraftLengthPolicy(k) if k else None
        start = time.perf_counter()
        records = list(
            moespec_generate(
                target,
                prompt,
                max_tokens=n,
                drafter=drafter,
                draft_policy=policy,
                kernels=KernelPolicy("slot"),
            )
        )
        return time.perf_counter() - start, [t for r in records for t in r.tokens]

    return run


def transformers_runner(target, draft, prompt, k):
    ids = torch.tensor([prompt])

    def run(n):
        kwargs = {"assistant_model": draft} if k else {}
        start = time.perf_counter()
        with torch.no_grad():
            out = target.generate(
                ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **kwargs
            )
        return time.perf_counter() - start, out[0, len(prompt) :].tolist()

    return run


def per_token(run, tokens):
    full, produced = run(tokens + 1)
    first, _ = run(1)
    return (full - first) / tokens, produced


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path)
    parser.add_argument("--draft", type=Path)
    parser.add_argument("--draft-length", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    if args.out.exists() and not args.force:
        parser.error(f"{args.out} exists (use --force)")
    import transformers

    if args.target is None or args.draft is None:
        from moespec.demo import demo_paths

        args.target, args.draft = demo_paths()
    k = args.draft_length
    ours_target, tokenizer = load_model(args.target, dtype="bf16")
    ours_draft, _ = load_model(args.draft, dtype="bf16")
    hf_target = transformers.AutoModelForCausalLM.from_pretrained(
        args.target, dtype=torch.bfloat16
    ).eval()
    hf_draft = transformers.AutoModelForCausalLM.from_pretrained(
        args.draft, dtype=torch.bfloat16
    ).eval()
    hf_draft.generation_config.num_assistant_tokens = k
    hf_draft.generation_config.num_assistant_tokens_schedule = "constant"
    hf_draft.generation_config.assistant_confidence_threshold = 0.0

    results = {}
    for prompt_text in PROMPTS:
        prompt = tokenizer.encode(prompt_text)
        runners = {
            "moespec-plain": moespec_runner(ours_target, ours_draft, prompt, 0),
            f"moespec-k{k}": moespec_runner(ours_target, ours_draft, prompt, k),
            "transformers-plain": transformers_runner(hf_target, hf_draft, prompt, 0),
            f"transformers-assisted-k{k}": transformers_runner(hf_target, hf_draft, prompt, k),
        }
        for run in runners.values():
            run(4)  # warm up
        samples = {name: [] for name in runners}
        tokens = {}
        for _ in range(args.repeats):
            for name, run in runners.items():
                seconds, produced = per_token(run, args.tokens)
                samples[name].append(seconds)
                tokens[name] = produced
        reference = tokens["moespec-plain"]
        results[prompt_text] = {
            name: {
                "seconds_per_token": values,
                "tokens_per_second": 1 / statistics.median(values),
                "same_tokens_as_moespec_plain": tokens[name] == reference,
            }
            for name, values in samples.items()
        }
        row = results[prompt_text]
        print(
            repr(prompt_text[:30]),
            "  ".join(f"{name} {r['tokens_per_second']:.1f}" for name, r in row.items()),
            flush=True,
        )
    summary = {
        name: statistics.median(r[name]["tokens_per_second"] for r in results.values())
        for name in next(iter(results.values()))
    }
    summary["moespec_over_transformers_assisted"] = (
        summary[f"moespec-k{k}"] / summary[f"transformers-assisted-k{k}"]
    )
    report = {
        "benchmark": "assisted_vs_transformers",
        "provenance": provenance(),
        "settings": {
            "target": describe(args.target),
            "draft": describe(args.draft),
            "draft_length": k,
            "tokens": args.tokens,
            "repeats": args.repeats,
            "dtype": "bf16",
            "prompts": PROMPTS,
        },
        "results": results,
        "median_tokens_per_second": summary,
    }
    write_json(args.out, report, force=args.force)
    for name, value in summary.items():
        print(f"{name:34s} {value:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
