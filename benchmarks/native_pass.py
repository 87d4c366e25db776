"""The native model pass's time by tokens per pass: tau(n) / tau(1) on the demo target for the
slot and deduplicating expert orders, and the demo draft's one-token step against the
target's (what speculation pays per verification and per drafted token).

    python benchmarks/native_pass.py --threads 1
    PYTHONPATH=<a checkout of an earlier revision> python benchmarks/native_pass.py  # before

    python benchmarks/native_pass.py --threads 1 --out benchmarks/results/native_pass_demo.json

A 64-token prompt is fed first; each pass of n tokens at that depth (`--tokens text`, the
default: the next tokens of a held-out file of the demo corpus, which route as text routes;
`random`: uniform tokens, which route without locality) is timed and rolled back,
all_logits on (a verification pass's logits), 100 passes a round, the rounds interleaved over
the configurations; each configuration's reading is its best round's median (the least
disturbed by other work on the machine).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_draft_eval import prompts_from_held_out  # noqa: E402

from moespec.demo import demo_paths  # noqa: E402
from moespec.files import check_writable, write_json  # noqa: E402
from moespec.models import load_model  # noqa: E402
from moespec.provenance import provenance  # noqa: E402

SIZES = (1, 2, 3, 5, 9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--passes", type=int, default=100)
    parser.add_argument("--tokens", choices=("text", "random"), default="text")
    parser.add_argument("--out", help="results JSON")
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args()
    if args.out:
        check_writable(args.out, force=args.force)
    torch.set_num_threads(args.threads)
    if args.tokens == "random":
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, 4096, (1, 64), generator=g)
        tokens = {n: torch.randint(0, 4096, (1, n), generator=g) for n in SIZES}
    else:
        tokenizer = load_model(demo_paths()[0])[1]
        ids = prompts_from_held_out(tokenizer, 1, 64 + max(SIZES), 0)[0]["ids"]
        prompt = torch.tensor([ids[:64]])
        tokens = {n: torch.tensor([ids[64 : 64 + n]]) for n in SIZES}
    steps = {}
    for name, path in zip(("target", "draft"), demo_paths(), strict=True):
        model = load_model(path)[0]
        step, cache = model.native_step(), model.new_cache(capacity=512)
        step(prompt, cache, kernel="slot", all_logits=False)
        steps[name] = step, cache
    configs = [("target", n, k) for k in ("slot", "dedup") for n in SIZES] + [("draft", 1, "slot")]
    best = dict.fromkeys(configs, float("inf"))
    for _ in range(args.rounds):
        for config in configs:
            step, cache = steps[config[0]]
            times = []
            for _ in range(args.passes):
                start = time.perf_counter()
                step(tokens[config[1]], cache, kernel=config[2], all_logits=True)
                times.append(time.perf_counter() - start)
                cache.rollback(prompt.shape[1])
            best[config] = min(best[config], statistics.median(times))
    one = best[("target", 1, "slot")]
    print(f"threads {args.threads}: target tau(1) {one * 1e3:.3f} ms")
    for kernel in ("slot", "dedup"):
        ratios = " ".join(f"{n}: {best[('target', n, kernel)] / one:.2f}" for n in SIZES[1:])
        print(f"  {kernel:5s} tau(n)/tau(1)  {ratios}")
    draft = best[("draft", 1, "slot")]
    print(f"  draft step {draft * 1e3:.3f} ms = {draft / one:.2f} of the target's")
    if args.out:
        result = {
            "title": f"native pass, demo pair, {args.tokens} tokens, {args.threads} thread(s)",
            "provenance": provenance(settings=vars(args) | {"out": None}),
            "target_tau1_seconds": one,
            "tau_over_tau1": {
                kernel: {str(n): best[("target", n, kernel)] / one for n in SIZES}
                for kernel in ("slot", "dedup")
            },
            "draft_step_seconds": draft,
            "draft_over_target_step": draft / one,
        }
        write_json(args.out, result, force=args.force)


if __name__ == "__main__":
    main()
