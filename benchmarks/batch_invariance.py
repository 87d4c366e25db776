"""What batch invariance costs and buys: decode tokens/s with the target batch-invariant and
without, side by side, and whether greedy speculation then equals plain greedy decoding.

    python benchmarks/batch_invariance.py --out benchmarks/results/batch_invariance_demo.json

On the demo pair in bf16, held-out prompts (the test part of the embedded corpus), greedy:
plain decoding, the draft model at k = 4 and 8, and `--draft auto`, each with invariance on and
off, in rounds of a seeded random order in one process. Ratios are paired within a round (on /
off, same prompt and mode); identity compares each speculative run with the plain run of the
same setting. Written after every round.
"""

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moespec.bench.stats import ratio_range  # noqa: E402
from moespec.calibrate.plan import verify_documents  # noqa: E402
from moespec.decoding import (  # noqa: E402
    DraftLengthPolicy,
    ModelDrafter,
    Sampler,
    generate,
    summarize,
)
from moespec.decoding.setup import speculation_factory  # noqa: E402
from moespec.demo import demo_paths  # noqa: E402
from moespec.files import check_writable, write_json  # noqa: E402
from moespec.models import load_model  # noqa: E402
from moespec.provenance import provenance  # noqa: E402

MODES = ("plain", "model:4", "model:8", "auto")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    check_writable(args.out, force=args.force)
    if args.threads:
        torch.set_num_threads(args.threads)
    target_dir, draft_dir = demo_paths()
    target, tokenizer = load_model(target_dir, dtype="bf16")
    draft, _ = load_model(draft_dir, dtype="bf16")
    documents = verify_documents(args.prompts, 8000)
    prompts = [tokenizer.encode(d.text)[: args.prompt_tokens] for d in documents]

    def run(prompt, mode, invariant, tokens):
        target.batch_invariant = invariant
        drafter = policy = None
        if mode.startswith("model"):
            drafter = ModelDrafter(draft, Sampler(), target.config.vocab_size)
            policy = DraftLengthPolicy(int(mode.split(":")[1]))
        elif mode == "auto":
            drafter = speculation_factory(
                f"auto:{draft_dir}",
                target=target,
                tokenizer=tokenizer,
                sampler=Sampler(),
                prompt=prompt,
                max_tokens=tokens,
                dtype="bf16",
            )()
        records = list(
            generate(target, prompt, max_tokens=tokens, drafter=drafter, draft_policy=policy)
        )
        return summarize(records)["tokens_per_second"], [t for r in records for t in r.tokens]

    for mode in MODES:  # the same warm-up for every arm
        for invariant in (True, False):
            run(prompts[0], mode, invariant, 16)
    rng = random.Random(args.seed)
    rounds = []
    for r in range(args.rounds):
        arms = [(i, mode, inv) for i in range(len(prompts)) for mode in MODES for inv in (1, 0)]
        rng.shuffle(arms)
        results = {
            (i, mode, inv): run(prompts[i], mode, bool(inv), args.tokens) for i, mode, inv in arms
        }
        rounds.append(results)
        summary = {}
        for mode in MODES:
            ratios = [
                res[(i, mode, 1)][0] / res[(i, mode, 0)][0]
                for res in rounds
                for i in range(len(prompts))
            ]
            same = {
                inv: sum(
                    res[(i, mode, inv)][1] == res[(i, "plain", inv)][1]
                    for res in rounds
                    for i in range(len(prompts))
                )
                for inv in (1, 0)
            }
            summary[mode] = {
                "invariant_over_off_tokens_per_second": ratio_range(ratios),
                "same_tokens_as_plain": {
                    "invariant": same[1],
                    "off": same[0],
                    "runs": len(rounds) * len(prompts),
                },
                "tokens_per_second_median": {
                    "invariant": statistics.median(
                        res[(i, mode, 1)][0] for res in rounds for i in range(len(prompts))
                    ),
                    "off": statistics.median(
                        res[(i, mode, 0)][0] for res in rounds for i in range(len(prompts))
                    ),
                },
            }
        result = {
            "benchmark": "batch_invariance",
            "provenance": provenance(),
            "settings": {**vars(args), "dtype": "bf16", "greedy": True, "modes": MODES},
            "prompts": [d.name for d in documents],
            "rounds_done": r + 1,
            "summary": summary,
        }
        write_json(args.out, result, force=True if r else args.force)
        print(f"round {r + 1}: {summary}", file=sys.stderr, flush=True)
    for mode, row in summary.items():
        ratio = row["invariant_over_off_tokens_per_second"]
        same = row["same_tokens_as_plain"]
        print(
            f"{mode:8s} invariant/off {ratio['median']:.3f} "
            f"({ratio['min']:.3f}-{ratio['max']:.3f}); "
            f"same tokens as plain: invariant {same['invariant']}/{same['runs']}, "
            f"off {same['off']}/{same['runs']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
