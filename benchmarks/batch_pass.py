"""A batched native pass against its sequences' passes one by one, on the demo target (bf16).

    python benchmarks/batch_pass.py --threads 1 --out /tmp/batch_pass_1t.json
    python benchmarks/batch_pass.py --threads 2 --out /tmp/batch_pass_2t.json

B sequences (B = 1, 2, 4, 8), each after a prompt of its own (`--context` tokens of a
different held-out file of the demo corpus, `--tokens text`, or uniform random tokens), each
fed k + 1 tokens (k = 0: a decode step; k = 2, 4: a verification of k drafts): one
`batch_pass` of all B sequences (moespec.models.batch: one native call) against B separate
passes (`model(tokens, cache)`, one native call each), in each expert order. Every pass is
timed and rolled back, `--passes` a round, the rounds interleaved over all configurations in
one process; each configuration's reading is the median of its rounds' medians, with their
range. Aggregate tokens/s: the B (k + 1) tokens over the time.
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
from moespec.models.batch import batch_pass  # noqa: E402
from moespec.provenance import provenance  # noqa: E402

SIZES = (1, 2, 4, 8)
DRAFTS = (0, 2, 4)
KERNELS = ("slot", "dedup")
MODES = ("batched", "separate")


def streams(tokenizer, args) -> list[list[int]]:
    """Per sequence its prompt and the tokens it is fed after it (context + max k + 1)."""
    length = args.context + max(DRAFTS) + 1
    if args.tokens == "random":
        g = torch.Generator().manual_seed(0)
        return [torch.randint(0, 4096, (length,), generator=g).tolist() for _ in range(max(SIZES))]
    return [p["ids"] for p in prompts_from_held_out(tokenizer, max(SIZES), length, 0)]


def timed(model, mode: str, feeds, caches, kernel: str) -> float:
    """Seconds of one batched pass of the feeds, or of their passes one by one; the caches
    rolled back after (untimed)."""
    lengths = [c.length for c in caches]
    start = time.perf_counter()
    if mode == "batched":
        batch_pass(model, feeds, caches, kernel=kernel, all_logits=True)
    else:
        for tokens, cache in zip(feeds, caches, strict=True):
            model(tokens[None], cache, kernel=kernel, all_logits=True)
    seconds = time.perf_counter() - start
    for cache, length in zip(caches, lengths, strict=True):
        cache.rollback(length)
    return seconds


def measure(model, caches, feeds, args) -> dict:
    """{(B, k, kernel, mode): [each round's median seconds]}, rounds interleaved."""
    configs = [(b, k, kernel, mode) for k in DRAFTS for b in SIZES for kernel in KERNELS
               for mode in MODES]  # fmt: skip
    rounds = {c: [] for c in configs}
    for _ in range(args.rounds):
        for b, k, kernel, mode in configs:
            fed = [f[: k + 1] for f in feeds[:b]]
            times = [timed(model, mode, fed, caches[:b], kernel) for _ in range(args.passes)]
            rounds[(b, k, kernel, mode)].append(statistics.median(times))
    return rounds


def summary(rounds: dict) -> list[dict]:
    rows = []
    for (b, k, kernel, mode), medians in rounds.items():
        if mode != "batched":
            continue
        separate = rounds[(b, k, kernel, "separate")]
        row = {"batch": b, "k": k, "tokens": b * (k + 1), "kernel": kernel}
        for name, values in (("batched", medians), ("separate", separate)):
            median = statistics.median(values)
            row[f"{name}_seconds"] = median
            row[f"{name}_range"] = [min(values), max(values)]
            row[f"{name}_tokens_per_second"] = b * (k + 1) / median
        row["speedup"] = row["separate_seconds"] / row["batched_seconds"]
        rows.append(row)
    return rows


def report(rows: list[dict], threads: int) -> None:
    print(f"threads {threads}: ms per pass, median [range] of rounds; aggregate tokens/s")
    print(" k  B kernel  batched               separate              speedup  tok/s b / s")
    for r in rows:
        ms = {m: [1e3 * r[f"{m}_seconds"], *(1e3 * x for x in r[f"{m}_range"])] for m in MODES}
        print(
            f"{r['k']:2d} {r['batch']:2d} {r['kernel']:6s}"
            + "".join(f"  {a:6.3f} [{lo:.3f}-{hi:.3f}]" for a, lo, hi in ms.values())
            + f"  {r['speedup']:5.2f}x"
            + f"  {r['batched_tokens_per_second']:6.0f} / {r['separate_tokens_per_second']:6.0f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--passes", type=int, default=30)
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    parser.add_argument("--tokens", choices=("text", "random"), default="text")
    parser.add_argument("--out", help="results JSON")
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args()
    if args.out:
        check_writable(args.out, force=args.force)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(demo_paths()[0], dtype="bf16")
    if model.native_step() is None:
        raise SystemExit(f"no native pass here: {model.native_report()['note']}")
    caches, feeds = [], []
    for ids in streams(tokenizer, args):
        cache = model.new_cache(capacity=args.context + 64)
        model(torch.tensor([ids[: args.context]]), cache)
        caches.append(cache)
        feeds.append(torch.tensor(ids[args.context :]))
    rows = summary(measure(model, caches, feeds, args))
    report(rows, args.threads)
    if args.out:
        result = {
            "title": f"batched native pass vs one by one, demo target, {args.threads} thread(s)",
            "provenance": provenance(settings=vars(args) | {"out": None}),
            "context": args.context,
            "rows": rows,
        }
        write_json(args.out, result, force=args.force)


if __name__ == "__main__":
    main()
