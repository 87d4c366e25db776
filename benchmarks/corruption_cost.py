"""What a wrong draft's token costs a deduplicating verify pass: the oracle's two readings of
"corrupt a draft" timed side by side.

    python benchmarks/corruption_cost.py --out benchmarks/results/corruption_cost_demo.json

A pass of n tokens as the sweep of `moespec evaluate` runs it (the last accepted token, then
n - 1 drafts) on a cache holding a held-out prompt and half of its greedy continuation. The arms:
the greedy continuation itself (every draft right), and at each acceptance the oracle's drafts
with its wrong ones proposing a token drawn from the whole vocabulary ("uniform") or the
target's best token other than the greedy one ("runner-up", `runner_up_tokens`); both on the
same per-position flags. Each round times every (prompt, arm) once in a seeded random order,
in one process; each arm's ratio is paired with the greedy arm of the same round and prompt.
Beside the times, the mean number of distinct experts per layer each arm's pass routes to
(what the deduplicating kernel reads). Written after every round; Ctrl-C keeps those done.
"""

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moespec.bench.stats import ratio_range  # noqa: E402
from moespec.calibrate.evaluate import evaluation_prompts  # noqa: E402
from moespec.cli.options import checkpoint_dir, number_in, positive_int  # noqa: E402
from moespec.decoding import KernelPolicy, OracleDrafter  # noqa: E402
from moespec.decoding.setup import greedy_reference, runner_up_tokens  # noqa: E402
from moespec.demo import demo_paths, describe  # noqa: E402
from moespec.files import check_writable, write_json  # noqa: E402
from moespec.models import load_model  # noqa: E402
from moespec.provenance import provenance  # noqa: E402

ACCEPTANCE = number_in(0, 1, high_open=True)


def acceptances(text: str) -> list[float]:
    """--acceptances: comma-separated values in [0, 1)."""
    return [ACCEPTANCE(x) for x in text.split(",")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", type=checkpoint_dir, help="checkpoint (default: the demo target)"
    )
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--kernel", default="dedup")
    parser.add_argument("--n", type=positive_int, default=9, help="tokens per pass")
    parser.add_argument("--acceptances", type=acceptances, default=[0.5, 0.8])
    parser.add_argument("--prompts", type=positive_int, default=3)
    parser.add_argument("--prompt-tokens", type=positive_int, default=64)
    parser.add_argument("--tokens", type=positive_int, default=256, help="continuation length")
    parser.add_argument("--rounds", type=positive_int, default=60)
    parser.add_argument("--warmup", type=int, default=5, help="rounds run and not kept")
    parser.add_argument("--threads", type=positive_int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    if args.tokens < 2 * args.n:
        parser.error(f"--tokens {args.tokens}: at least twice --n ({args.n})")
    try:
        check_writable(args.out, force=args.force)
    except FileExistsError:
        raise SystemExit(
            f"corruption_cost.py: {args.out} exists: pass --force to overwrite it"
        ) from None
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else demo_paths()[0]
    model, tokenizer = load_model(model_dir, dtype=args.dtype)
    model.batch_invariant = True  # as `moespec evaluate` runs it
    kernels = KernelPolicy("auto", crossover=2)
    vocab = model.config.vocab_size

    cases = []  # per prompt: (cache, depth, {arm: pass tokens})
    try:
        prompts = evaluation_prompts(tokenizer, args.prompts, args.prompt_tokens)
    except ValueError as e:
        parser.error(f"--prompts {args.prompts}, --prompt-tokens {args.prompt_tokens}: {e}")
    for index, prompt in enumerate(prompts):
        reference = greedy_reference(model, prompt, args.tokens, kernels)
        alternatives = runner_up_tokens(model, prompt, reference, args.kernel)
        depth = len(prompt) + args.tokens // 2
        stream = prompt + reference
        context = stream[: depth + 1]  # the pass starts with the last accepted token
        arms = {"greedy": stream[depth : depth + args.n]}
        for a in args.acceptances:
            for name, alt in (("uniform", None), ("runner-up", alternatives)):
                oracle = OracleDrafter(
                    reference, len(prompt), a, vocab, seed=args.seed * 1_009 + index,
                    positional=True, alternatives=alt,
                )  # fmt: skip
                arms[f"{name} a={a}"] = [stream[depth], *oracle.propose(context, args.n - 1).tokens]
        cache = model.new_cache(capacity=depth + args.n + 1)
        model(torch.tensor(stream[:depth]), cache, kernel=args.kernel)
        cases.append((cache, depth, arms))
    names = list(cases[0][2])

    def run(cache, depth, tokens, sink=None):
        start = time.perf_counter()
        model(torch.tensor(tokens), cache, kernel=args.kernel, all_logits=True, routing_sink=sink)
        elapsed = time.perf_counter() - start
        cache.rollback(depth)
        return elapsed

    experts = {}  # arm: distinct experts per layer, mean over prompts and layers
    for name in names:
        counts = []
        for cache, depth, arms in cases:
            run(
                cache,
                depth,
                arms[name],
                lambda layer, ids, w, c=counts: c.append(ids.unique().numel()),
            )
        experts[name] = statistics.mean(counts)

    rng = random.Random(args.seed)
    times = {name: [] for name in names}  # kept rounds, [round][prompt] flattened
    rounds = []
    try:
        for r in range(args.warmup + args.rounds):
            order = [(i, name) for i in range(len(cases)) for name in names]
            rng.shuffle(order)
            got = {}
            for i, name in order:
                cache, depth, arms = cases[i]
                got[i, name] = run(cache, depth, arms[name])
            if r < args.warmup:
                continue
            rounds.append(r)
            for (_, name), seconds in sorted(got.items()):
                times[name].append(seconds)
            summary = {
                name: {
                    "seconds_median": statistics.median(times[name]),
                    "over_greedy": ratio_range(
                        [x / y for x, y in zip(times[name], times["greedy"], strict=True)]
                    ),
                    "distinct_experts_per_layer": experts[name],
                }
                for name in names
            }
            result = {
                "benchmark": "corruption_cost",
                "provenance": provenance(),
                "settings": {**vars(args), "model": describe(model_dir)},
                "passes": {name: [arms[name] for _, _, arms in cases] for name in names},
                "rounds_done": len(rounds),
                "summary": summary,
            }
            result["settings"].pop("out")
            write_json(args.out, result, force=True if rounds[1:] else args.force)
    except KeyboardInterrupt:
        print(f"interrupted: {len(rounds)} rounds kept in {args.out}", file=sys.stderr)
        return 130
    for name, row in summary.items():
        ratio = row["over_greedy"]
        print(
            f"{name:18s} {row['seconds_median'] * 1e3:7.3f} ms  over greedy "
            f"{ratio['median']:.3f} ({ratio['min']:.3f}-{ratio['max']:.3f})  "
            f"experts/layer {row['distinct_experts_per_layer']:.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
