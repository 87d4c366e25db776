"""Decode tokens/s at batch 1: moespec bf16 against moespec int8 experts and transformers.

    python benchmarks/int8_decode.py --shape olmoe --threads 1,2 \
        --out benchmarks/results/int8_decode_olmoe.json

One random-weight bf16 checkpoint of real expert shapes (written once by transformers) is
loaded several ways in one process: moespec with bf16 weights, moespec with `--weights int8`
(experts, attention and head in int8, one scale per output channel; routers, norms and the
embedding table bf16), moespec with `--weights int8-experts` (the experts alone in int8), and
transformers (bf16). At each thread count every engine is warmed once, then timed in
rounds, each round every engine once, the order rotating by one per round; a run's decode
time per token is (time of N + 1 tokens - time of 1) / N, for every engine alike. Ratios are
paired within rounds (median and range), so a machine whose load changes between rounds
still compares like with like. Bytes read per token are over this machine's read bandwidth
(`moespec.calibrate.timing.read_bandwidth`, at the same thread count, best of before and after).

Agreement of int8 with bf16 (not bit equality): on the embedded demo model (trained, so its
greedy tokens mean something) and on the random checkpoint, for each prompt,
- prefix agreement: the share of the N greedy tokens before int8's first divergence from bf16;
- teacher-forced top-1: on bf16's greedy sequence, the share of positions where int8's argmax
  equals bf16's.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from moespec.bench.checkpoints import SHAPES, random_checkpoint
from moespec.bench.stats import ratio_range
from moespec.calibrate.timing import read_bandwidth
from moespec.decoding import KernelPolicy, generate
from moespec.files import write_json
from moespec.kernels.cpu import weight_paths
from moespec.models import load_model
from moespec.provenance import provenance


def moespec_tokens(model, prompt, n, kernel="slot"):
    records = generate(model, prompt, max_tokens=n, kernels=KernelPolicy(kernel))
    return [t for r in records for t in r.tokens]


def decode_seconds(run, tokens: int) -> float:
    """Seconds per decoded token: a run of tokens + 1 minus a run of 1 (prefill, first)."""

    def timed(n):
        start = time.perf_counter()
        run(n)
        return time.perf_counter() - start

    return (timed(tokens + 1) - timed(1)) / tokens


def transformers_run(model, prompt):
    ids = torch.tensor([prompt])

    def run(n):
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    return run


def paired(samples: dict, numerator: str, denominator: str) -> dict:
    """Speedup of `denominator` over `numerator` per round: time ratio, median and range."""
    return ratio_range(
        [a / b for a, b in zip(samples[numerator], samples[denominator], strict=True)]
    )


def time_engines(engines: dict, tokens: int, rounds: int) -> dict:
    """{engine: [seconds per token per round]}, the order rotating by one each round."""
    for run in engines.values():
        decode_seconds(run, tokens)  # warm-up, the same for every engine
    names = list(engines)
    samples = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            samples[name].append(decode_seconds(engines[name], tokens))
    return samples


def agreement(plain, int8, prompts, tokens: int) -> dict:
    """Prefix agreement and teacher-forced top-1 agreement of int8 with bf16 (module doc)."""
    prefix, forced = [], []
    for prompt in prompts:
        reference = moespec_tokens(plain, prompt, tokens)
        got = moespec_tokens(int8, prompt, tokens)
        pairs = enumerate(zip(reference, got, strict=True))
        same = next((i for i, (a, b) in pairs if a != b), tokens)
        prefix.append(same / tokens)
        sequence = torch.tensor(prompt + reference[:-1])
        a = plain(sequence, plain.new_cache(), all_logits=True)[0, len(prompt) - 1 :]
        b = int8(sequence, int8.new_cache(), all_logits=True)[0, len(prompt) - 1 :]
        forced.append((a.argmax(-1) == b.argmax(-1)).float().mean().item())
    return {
        "prompts": len(prompts),
        "tokens": tokens,
        "prefix_agreement": prefix,
        "prefix_agreement_mean": statistics.mean(prefix),
        "teacher_forced_top1": forced,
        "teacher_forced_top1_mean": statistics.mean(forced),
    }


def demo_agreement(formats, tokens: int, prompts: int) -> dict:
    """{format: agreement with bf16} on the embedded demo target and held-out prompts."""
    from moespec.demo import demo_paths
    from moespec.demo.corpus import held_out_documents

    path = demo_paths()[0]
    plain, tokenizer = load_model(path, "bf16")
    texts = [d.text for d in held_out_documents(prompts, 2000)]
    ids = [tokenizer.encode(t)[:32] for t in texts]
    return {
        f: agreement(plain, load_model(path, "bf16", weights=f)[0], ids, tokens) for f in formats
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="olmoe")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--kernel", default="slot", choices=["slot", "dedup"])
    parser.add_argument("--formats", default="int8,int8-experts", help="int8 formats to time")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--agreement-prompts", type=int, default=8)
    parser.add_argument("--cache-dir", type=Path, default=Path("benchmarks/checkpoints"))
    parser.add_argument("--note", default="", help="free text kept in the JSON (e.g. the load)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    if args.out.exists() and not args.force:
        parser.error(f"{args.out} exists (use --force)")
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    path = random_checkpoint(args.shape, args.cache_dir, args.layers)
    formats = args.formats.split(",")
    models = {"bf16": load_model(path, "bf16")[0]}
    models.update({f: load_model(path, "bf16", weights=f)[0] for f in formats})
    bf16 = models["bf16"]
    prompt = list(range(1, args.prompt_tokens + 1))
    engines = {
        f"moespec-{f}": (lambda n, m=m: moespec_tokens(m, prompt, n, args.kernel))
        for f, m in models.items()
    }
    if not args.no_transformers:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        engines["transformers-bf16"] = transformers_run(hf, prompt)
    # dense bytes plus m experts per MoE layer, as held (int8 values and scales)
    nbytes = {f"moespec-{f}": m.step_bytes() for f, m in models.items()}
    nbytes["transformers-bf16"] = nbytes["moespec-bf16"]

    torch.set_num_threads(1)  # agreement is counted, not timed: one thread is enough
    random_prompts = [list(range(1 + 7 * i, 17 + 7 * i)) for i in range(args.agreement_prompts)]
    by_threads = {}
    report = {
        "benchmark": "int8_decode",
        "provenance": provenance(),
        "cpu": weight_paths("int8", torch.bfloat16)["cpu"],
        "paths": {f: weight_paths(m.expert_format, m.dense_format) for f, m in models.items()},
        "settings": {
            **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "checkpoint": str(path),
            "model_shape": SHAPES[args.shape],
            "layers": bf16.config.num_layers,
            "int8": "one scale per output channel (torch._weight_int8pack_mm); int8: experts, "
            "attention, head; int8-experts: experts alone; routers, norms, embeddings bf16",
            "batch": 1,
        },
        "bytes_per_token": nbytes,
        "agreement": {
            "random_checkpoint": {
                f: agreement(bf16, models[f], random_prompts, args.tokens) for f in formats
            },
            "demo": demo_agreement(formats, args.tokens, args.agreement_prompts),
        },
        "results": by_threads,
    }
    write_json(args.out, report, force=True)  # kept as each thread count finishes
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        bandwidths = [read_bandwidth()]
        samples = time_engines(engines, args.tokens, args.rounds)
        bandwidths.append(read_bandwidth())
        by_threads[str(threads)] = summarize(samples, nbytes, max(bandwidths), bandwidths, formats)
        print_summary(threads, by_threads[str(threads)])
        write_json(args.out, report, force=True)
    for name, by_format in report["agreement"].items():
        for f, a in by_format.items():
            print(
                f"agreement {name} {f}: prefix {a['prefix_agreement_mean']:.3f}, "
                f"teacher-forced top-1 {a['teacher_forced_top1_mean']:.3f}"
            )
    return 0


def summarize(samples: dict, nbytes: dict, bandwidth: float, bandwidths: list, formats) -> dict:
    out = {"read_bandwidth_bytes_per_second": bandwidth, "read_bandwidth_samples": bandwidths}
    for name, seconds in samples.items():
        median = statistics.median(seconds)
        out[name] = {
            "seconds_per_token": seconds,
            "tokens_per_second": 1 / median,
            "tokens_per_second_range": [1 / max(seconds), 1 / min(seconds)],
            "bytes_per_second": nbytes[name] / median,
            "fraction_of_read_bandwidth": nbytes[name] / median / bandwidth,
        }
    for f in formats:
        out[f"{f}_over_bf16"] = paired(samples, "moespec-bf16", f"moespec-{f}")
    if "transformers-bf16" in samples:
        for f in ["bf16", *formats]:
            out[f"{f}_over_transformers"] = paired(samples, "transformers-bf16", f"moespec-{f}")
    return out


def print_summary(threads: int, result: dict) -> None:
    bandwidth = result["read_bandwidth_bytes_per_second"]
    for name, r in result.items():
        if isinstance(r, dict) and "tokens_per_second" in r:
            low, high = r["tokens_per_second_range"]
            print(
                f"{threads} thread(s) {name:18s} {r['tokens_per_second']:6.2f} tok/s "
                f"({low:.2f}-{high:.2f})  {r['bytes_per_second'] / 1e9:5.1f} GB/s "
                f"({r['fraction_of_read_bandwidth']:.0%} of {bandwidth / 1e9:.1f})"
            )
    for key, r in result.items():
        if key.endswith(("_over_bf16", "_over_transformers")):
            print(f"{threads} thread(s) {key}: {r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})")


if __name__ == "__main__":
    sys.exit(main())
