"""The native model pass's time by tokens per pass: tau(n) / tau(1) on the demo target for the
slot and deduplicating expert orders, and the demo draft's one-token step against the
target's (what speculation pays per verification and per drafted token).

    python benchmarks/native_pass.py --threads 1
    PYTHONPATH=<a checkout of an earlier revision> python benchmarks/native_pass.py  # before

A 64-token prompt is fed first; each pass of n random tokens at that depth is timed and
rolled back, all_logits on (a verification pass's logits), 100 passes a round, the rounds
interleaved over the configurations; each configuration's reading is its best round's median
(the least disturbed by other work on the machine).
"""

import argparse
import statistics
import time

import torch

from moespec.demo import demo_paths
from moespec.models import load_model

SIZES = (1, 2, 3, 5, 9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--passes", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 4096, (1, 64), generator=g)
    tokens = {n: torch.randint(0, 4096, (1, n), generator=g) for n in SIZES}
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


if __name__ == "__main__":
    main()
