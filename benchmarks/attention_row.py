"""One-row (decode) bf16 attention: the library's path against moespec's native one, side by side.

    python benchmarks/attention_row.py --out benchmarks/results/attention_row.json

For head layouts of real models (query heads N, key heads K, head dim D) and cached positions
L, at 1 and 2 threads: the time of one query row's attention over a cache view as the engine
holds it ([1, K, capacity, D], narrowed to L), by

- "library": `F.scaled_dot_product_attention` exactly as `moespec.models.layers.attend` calls it
  without the native path (one call, query heads laid out as rows of their key head);
- "native": `moespec.kernels.native.attend_one` (fp32 scores, softmax and sums).

Rounds interleave the two arms, each warmed alike; the JSON keeps every round, the medians,
the paired per-round speedup with its range, and the largest difference from a float64
reference for each arm. `layers.attend` takes the native path up to 4 query heads per key head.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from moespec.bench.stats import ratio_range
from moespec.files import check_writable, write_json
from moespec.kernels.cpu import cpu_paths
from moespec.kernels.native import attend_one, attention_function
from moespec.provenance import provenance

# (name, query heads, key heads, head dim)
LAYOUTS = [
    ("olmoe-1b-7b", 16, 16, 128),
    ("qwen3-30b-a3b", 32, 4, 128),
    ("llama-3-8b", 32, 8, 128),
    ("demo-target", 4, 2, 64),
]


def library(q, keys, values):
    heads, dim = q.shape[2], q.shape[3]
    kv = keys.shape[1]
    if heads == kv:
        return F.scaled_dot_product_attention(q.transpose(1, 2), keys, values)
    return F.scaled_dot_product_attention(q.reshape(1, kv, heads // kv, dim), keys, values)


def reference(q, keys, values):
    heads, dim = q.shape[2], q.shape[3]
    kv = keys.shape[1]
    rows = q.double().reshape(kv, heads // kv, dim)
    scores = rows @ keys.double()[0].transpose(-1, -2) * dim**-0.5
    return (torch.softmax(scores, -1) @ values.double()[0]).reshape(-1)


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of positive integers (argparse type)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return values


def time_calls(call, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", type=positive_ints, default=[32, 128, 512, 2048])
    parser.add_argument("--threads", type=positive_ints, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=30, help="calls timed per round and arm")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    try:
        check_writable(args.out, force=args.force)
    except (OSError, ValueError) as e:
        parser.error(str(e))
    if attention_function() is None:
        parser.error(f"no native attention here: {cpu_paths().native or 'no AVX2 with FMA'}")
    positions, threads = args.positions, args.threads
    generator = torch.Generator().manual_seed(0)
    results = []
    for name, heads, kv, dim in LAYOUTS:
        for length in positions:
            cache = torch.randn(2, 1, kv, length + 64, dim, generator=generator).bfloat16()
            keys, values = cache[0, :, :, :length], cache[1, :, :, :length]
            q = torch.randn(1, 1, heads, dim, generator=generator).bfloat16()
            want = reference(q, keys, values)
            arms = {
                "library": lambda q=q, k=keys, v=values: library(q, k, v),
                "native": lambda q=q, k=keys, v=values, d=dim: attend_one(q, k, v, d**-0.5),
            }
            errors = {
                a: (f().double().reshape(-1) - want).abs().max().item() for a, f in arms.items()
            }
            for n in threads:
                torch.set_num_threads(n)
                samples = {a: [] for a in arms}
                for call in arms.values():
                    time_calls(call, args.calls)
                for _ in range(args.rounds):
                    for a, call in arms.items():
                        samples[a].append(time_calls(call, args.calls))
                ratios = [b / s for b, s in zip(samples["library"], samples["native"], strict=True)]
                row = {
                    "layout": name,
                    "heads": heads,
                    "kv_heads": kv,
                    "head_dim": dim,
                    "positions": length,
                    "threads": n,
                    "seconds": samples,
                    "median_us": {a: statistics.median(s) * 1e6 for a, s in samples.items()},
                    "native_speedup": ratio_range(ratios),
                    "max_abs_error": errors,
                }
                results.append(row)
                med, r = row["median_us"], row["native_speedup"]
                print(
                    f"{name:20s} L={length:5d} t={n}  library {med['library']:8.1f} us  "
                    f"native {med['native']:8.1f} us  x{r['median']:.2f} "
                    f"({r['min']:.2f}-{r['max']:.2f})"
                )
    report = {
        "benchmark": "attention_row",
        "provenance": provenance(settings={"threads": threads}),
        "cpu": cpu_paths().to_dict(),
        "settings": {**vars(args), "out": str(args.out)},
        "results": results,
    }
    write_json(args.out, report, force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
