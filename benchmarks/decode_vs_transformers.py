"""Decode tokens/s at batch 1: moespec against `transformers.generate`, side by side in one run.

    python benchmarks/decode_vs_transformers.py --shape olmoe \
        --out benchmarks/results/decode_olmoe.json

Both load the same random-weight bf16 checkpoint of real expert shapes (written once by
transformers). Each repeat times moespec and transformers back to back; a run's decode time is
the time of generating N + 1 tokens minus that of generating 1 (prefill and first token), so
both engines are measured the same way. Also reports bytes read per token over this machine's
measured read bandwidth.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moespec.bench.checkpoints import SHAPES, random_checkpoint  # noqa: E402
from moespec.bench.stats import ratio_range  # noqa: E402
from moespec.calibrate.timing import read_bandwidth  # noqa: E402
from moespec.decoding import KernelPolicy, generate  # noqa: E402
from moespec.files import write_json  # noqa: E402
from moespec.models import load_model  # noqa: E402
from moespec.provenance import provenance  # noqa: E402


def time_moespec(model, prompt, tokens, kernel):
    def run(n):
        start = time.perf_counter()
        for _ in generate(model, prompt, max_tokens=n, kernels=KernelPolicy(kernel)):
            pass
        return time.perf_counter() - start

    return (run(tokens + 1) - run(1)) / tokens


def time_transformers(model, prompt, tokens):
    ids = torch.tensor([prompt])

    def run(n):
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    return (run(tokens + 1) - run(1)) / tokens


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="olmoe")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument(
        "--experts",
        default="grouped_mm",
        help="transformers experts implementation(s), comma-separated",
    )
    parser.add_argument("--cache-dir", type=Path, default=Path("benchmarks/checkpoints"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    if args.out.exists() and not args.force:
        parser.error(f"{args.out} exists (use --force)")
    import transformers

    args.cache_dir.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    path = random_checkpoint(args.shape, args.cache_dir, args.layers)
    ours, _ = load_model(path, dtype="bf16")
    config = ours.config
    prompt = list(range(1, args.prompt_tokens + 1))
    bandwidths = [read_bandwidth()]  # again at the end: the largest is the denominator

    engines = {"moespec-slot": lambda: time_moespec(ours, prompt, args.tokens, "slot")}
    for name in args.experts.split(","):
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16, experts_implementation=name
        ).eval()
        engines[f"transformers-{name}"] = lambda hf=hf: time_transformers(hf, prompt, args.tokens)
    for fn in engines.values():  # warm up every engine once
        fn()
    samples = {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, fn in engines.items():
            samples[name].append(fn())

    bandwidths.append(read_bandwidth())
    bandwidth = max(bandwidths)
    sizes = ours.parameter_bytes()
    expert_bytes = next(iter(ours.moe_blocks.values())).experts.bytes_per_expert
    per_token = sizes["dense"] + config.num_moe_layers * config.top_k * expert_bytes
    results = {}
    for name, seconds in samples.items():
        median = statistics.median(seconds)
        results[name] = {
            "seconds_per_token": seconds,
            "median_seconds_per_token": median,
            "tokens_per_second": 1 / median,
            "bytes_per_second": per_token / median,
            "fraction_of_read_bandwidth": per_token / median / bandwidth,
        }
    ours_rate = results["moespec-slot"]["tokens_per_second"]
    for name in results:
        results[name]["moespec_speedup"] = ours_rate / results[name]["tokens_per_second"]
        # Runs of one repeat are back to back: their ratio cancels slow drift of the machine.
        paired = [b / a for a, b in zip(samples["moespec-slot"], samples[name], strict=True)]
        results[name]["moespec_speedup_paired"] = ratio_range(paired)
    report = {
        "benchmark": "decode_vs_transformers",
        "provenance": provenance(),
        "settings": {
            **vars(args),
            "out": str(args.out),
            "cache_dir": str(args.cache_dir),
            "checkpoint": str(path),
            "model_shape": SHAPES[args.shape],
            "layers": config.num_layers,
            "dtype": "bf16",
            "batch": 1,
        },
        "read_bandwidth_bytes_per_second": bandwidth,
        "read_bandwidth_samples": bandwidths,
        "bytes_per_token": per_token,
        "results": results,
    }
    write_json(args.out, report, force=args.force)
    for name, r in results.items():
        print(
            f"{name:28s} {r['tokens_per_second']:7.2f} tok/s  "
            f"{r['bytes_per_second'] / 1e9:6.1f} GB/s ({r['fraction_of_read_bandwidth']:.0%} "
            f"of {bandwidth / 1e9:.1f} GB/s)  moespec x{r['moespec_speedup']:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
