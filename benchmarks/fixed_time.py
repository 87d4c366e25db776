"""The fixed time of a decode step: the demo target and draft, before/after, beside transformers.

    git archive COMMIT | tar -x -C /tmp/before   # the tree to compare with
    python benchmarks/fixed_time.py --before /tmp/before --before-label COMMIT \
        --out benchmarks/results/fixed_time.json

For each model of the embedded demo pair (moespec/demo/target, a 14M Qwen3-MoE; and
moespec/demo/draft, a 2-layer dense Qwen3), at 1 and 2 intra-op threads, greedy bf16 plain
decoding of --tokens tokens after the same prompt, by each engine:

- "moespec": this tree; "moespec-before": the tree at --before (e.g. a checkout of the commit
  before the fixed-time work), run by the same worker code on its own package;
- "transformers": `generate` on the same checkpoint, greedy, its default kernels;
- "llama.cpp": through `llama-cpp-python` on GGUF files given with --gguf-target/--gguf-draft
  (optional: recorded as skipped, with the reason, when the package or the files are absent).

Every (engine, model, threads) arm runs in its own worker process, one measurement per round,
arms interleaved in rounds, so that every engine sees the same drift of a shared machine; each
worker warms its engine up first. A measurement's time per token is (time of N + 1 tokens -
time of 1 token) / N, the prefill and the first token cancelling, the median of --repeats.

Fixed time (seed 000 eq. 5): a one-token step is tau(1) = t0 + D(1)/beta_D + m W/beta(1) +
phi(1) plus the host's time; its part that does not grow with bytes is what is left after the
bytes. Here  fixed = step time - B / beta,  with B the bytes a one-token step reads (dense
weights incl. the head, m experts per MoE layer, the keys and values at the mean depth) and
beta the best read bandwidth measured on this machine at the same thread count (the larger of
summing a 1 GiB buffer and the library's bf16 GEMV streaming 64 MiB of distinct weights, or
twice the last-level cache where that is more).
Weights that stay in the last-level cache between steps read faster than beta, so this
fixed time is a lower bound of the true one.
Paired ratios are per round (same round, adjacent processes) with their range.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PROMPT = "def fibonacci(n):"


def per_token(run, tokens: int, repeats: int) -> float:
    """Median over repeats of (run(N + 1) - run(1)) / N, after one warm-up of each."""
    run(1), run(tokens + 1)
    samples = [(run(tokens + 1) - run(1)) / tokens for _ in range(repeats)]
    return statistics.median(samples)


def moespec_runner(directory: str):
    import torch

    from moespec.decoding import KernelPolicy, generate
    from moespec.models import load_model

    model, tokenizer = load_model(directory, dtype="bf16")
    prompt = tokenizer.encode(PROMPT)

    def run(n):
        start = time.perf_counter()
        for _ in generate(model, prompt, max_tokens=n, kernels=KernelPolicy("slot")):
            pass
        return time.perf_counter() - start

    torch.manual_seed(0)
    return run


def transformers_runner(directory: str):
    import torch
    import transformers
    from tokenizers import Tokenizer

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    model.eval()
    ids = torch.tensor([Tokenizer.from_file(f"{directory}/tokenizer.json").encode(PROMPT).ids])

    def run(n):
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    return run


def llamacpp_runner(gguf: str, threads: int):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=gguf, n_threads=threads, n_ctx=512, verbose=False)
    prompt = llm.tokenize(PROMPT.encode(), add_bos=False)

    def run(n):
        llm.reset()
        start = time.perf_counter()
        llm.create_completion(prompt, max_tokens=n, temperature=0.0, stop=[])
        return time.perf_counter() - start

    return run


def worker(args) -> int:
    """One arm's measurement, printed as one JSON line."""
    import torch

    torch.set_num_threads(args.threads)
    if args.engine.startswith("moespec"):
        run = moespec_runner(args.model_dir)
    elif args.engine == "transformers":
        run = transformers_runner(args.model_dir)
    else:
        run = llamacpp_runner(args.model_dir, args.threads)
    seconds = per_token(run, args.tokens, args.repeats)
    source = sys.modules["moespec"].__file__ if "moespec" in sys.modules else None
    print(json.dumps({"seconds_per_token": seconds, "moespec": source}))
    return 0


def spawn(engine, model_dir, threads, args, tree) -> float:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=str(threads))
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--engine", engine]
    command += ["--model-dir", str(model_dir), "--threads", str(threads)]
    command += ["--tokens", str(args.tokens), "--repeats", str(args.repeats)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{engine} worker failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["seconds_per_token"]


def step_bytes(directory, depth: int) -> int:
    """Bytes a one-token step reads: dense weights (head included), m experts per MoE
    layer, and the keys and values of `depth` positions."""
    from moespec.models import load_model

    model, _ = load_model(directory, dtype="bf16", pack=False)
    kv = model.config.num_layers * model.new_cache(capacity=1).layer_bytes(depth)  # MLA: latent
    return model.step_bytes() + kv


def gemv_bandwidth(threads: int) -> float:
    """Bytes/s of this CPU's bf16 GEMV path (the layout `moespec.kernels.linear.pack` gives:
    the native pair loops, oneDNN's packed product, or plain) over 64 MiB of distinct weights,
    or twice the last-level cache where that is more (`beyond_last_level_cache`)."""
    import torch

    from moespec.calibrate.timing import beyond_last_level_cache
    from moespec.kernels.linear import linear, pack

    torch.set_num_threads(threads)
    count = beyond_last_level_cache(64 * 2**20) // (1024 * 1024 * 2)
    dense = [torch.randn(1024, 1024).to(torch.bfloat16) for _ in range(count)]
    weights = [pack(w) for w in dense]
    x = torch.randn(1, 1024).to(torch.bfloat16)
    best = float("inf")
    for _ in range(10):
        start = time.perf_counter()
        for w in weights:
            linear(x, w)
        best = min(best, time.perf_counter() - start)
    return sum(w.nbytes for w in dense) / best


def read_bandwidths(threads: int) -> dict:
    import torch

    from moespec.calibrate.timing import read_bandwidth

    torch.set_num_threads(threads)
    return {"buffer_sum": read_bandwidth(), "bf16_gemv": gemv_bandwidth(threads)}


def arms(args, demo):
    """(engine, model name, model dir or GGUF, tree or None) of every arm measured."""
    skipped = {}
    out = []
    for name, directory in demo.items():
        out.append(("moespec", name, directory, REPO))
        if args.before:
            out.append(("moespec-before", name, directory, args.before))
        out.append(("transformers", name, directory, REPO))
        gguf = {"target": args.gguf_target, "draft": args.gguf_draft}[name]
        reason = llamacpp_missing(gguf)
        if reason:
            skipped[f"llama.cpp/{name}"] = reason
        else:
            out.append(("llama.cpp", name, gguf, REPO))
    return out, skipped


def llamacpp_missing(gguf) -> str | None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "llama-cpp-python is not installed (pip install llama-cpp-python)"
    if gguf is None or not Path(gguf).exists():
        return "no GGUF file of this checkpoint given (--gguf-target/--gguf-draft)"
    return None


def summarize(samples: dict, bandwidth: dict, nbytes: dict) -> dict:
    """Per arm: tokens/s, ms per token, fixed ms; paired per-round ratios against moespec."""
    # imported here: a worker of this script loads moespec from the tree it times
    from moespec.bench.stats import ratio_range

    results = {}
    for (engine, name, threads), seconds in samples.items():
        median = statistics.median(seconds)
        beta = max(bandwidth[threads].values())
        results[f"{engine}/{name}/{threads}"] = {
            "engine": engine,
            "model": name,
            "threads": threads,
            "ms_per_token": [s * 1e3 for s in seconds],
            "median_ms_per_token": median * 1e3,
            "min_ms_per_token": min(seconds) * 1e3,  # the round least disturbed by other work
            "tokens_per_second": 1 / median,
            "bytes_per_step": nbytes[name],
            "bytes_ms": nbytes[name] / beta * 1e3,
            "fixed_ms": (median - nbytes[name] / beta) * 1e3,
            "fixed_ms_at_min": (min(seconds) - nbytes[name] / beta) * 1e3,
        }
    for (engine, name, threads), seconds in samples.items():
        ours = samples[("moespec", name, threads)]
        ratios = [b / a for a, b in zip(ours, seconds, strict=True)]  # moespec speedup
        results[f"{engine}/{name}/{threads}"]["moespec_speedup_paired"] = ratio_range(ratios)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    parser.add_argument("--before", type=Path, help="another moespec tree to time alongside")
    parser.add_argument(
        "--before-label", help="what --before is, for the results (e.g. its commit)"
    )
    parser.add_argument("--gguf-target", help="the demo target as GGUF, for llama.cpp")
    parser.add_argument("--gguf-draft", help="the demo draft as GGUF, for llama.cpp")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.threads = int(args.threads)
        return worker(args)
    if args.out is None:
        parser.error("--out is required")
    from moespec.files import check_writable, write_json

    check_writable(args.out, force=args.force)
    sys.path.insert(0, str(HERE))
    from moespec.demo import demo_paths
    from moespec.provenance import provenance

    threads = [int(t) for t in args.threads.split(",")]
    demo = dict(zip(("target", "draft"), map(str, demo_paths()), strict=True))
    measured, skipped = arms(args, demo)
    nbytes = {name: step_bytes(d, depth=6 + args.tokens // 2) for name, d in demo.items()}
    bandwidth = {t: read_bandwidths(t) for t in threads}
    samples, load = {}, {"start": os.getloadavg()}
    for round_ in range(args.rounds):
        for t in threads:
            for engine, name, model_dir, tree in measured:
                seconds = spawn(engine, model_dir, t, args, tree)
                samples.setdefault((engine, name, t), []).append(seconds)
                print(f"round {round_ + 1} {engine:15s} {name:6s} {t} thr: {seconds * 1e3:.3f} ms")
    load["end"] = os.getloadavg()
    for t in threads:  # again at the end; the best of the two is the denominator
        for kind, value in read_bandwidths(t).items():
            bandwidth[t][kind] = max(bandwidth[t][kind], value)
    report = {
        "benchmark": "fixed_time",
        "provenance": provenance(),
        "settings": {
            **{k: v for k, v in vars(args).items() if k not in ("worker", "engine", "model_dir")},
            "threads": threads,
            "out": str(args.out),
            "before": args.before_label or (str(args.before) if args.before else None),
            "prompt": PROMPT,
            "dtype": "bf16",
            "batch": 1,
            "models": {name: "moespec/demo/" + name for name in demo},
        },
        "load_average_1_5_15_min": load,  # other work on the machine while it ran
        "read_bandwidth_bytes_per_second": {str(t): b for t, b in bandwidth.items()},
        "skipped": skipped,
        "results": summarize(samples, bandwidth, nbytes),
    }
    write_json(args.out, report, force=args.force)
    for key, r in report["results"].items():
        paired = r["moespec_speedup_paired"]
        print(
            f"{key:28s} {r['tokens_per_second']:7.1f} tok/s {r['median_ms_per_token']:6.3f} ms"
            f" (min {r['min_ms_per_token']:6.3f}) fixed {r['fixed_ms']:6.3f} ms"
            f" moespec x{paired['median']:.2f}"
            f" ({paired['min']:.2f}-{paired['max']:.2f})"
        )
    for key, reason in skipped.items():
        print(f"{key}: skipped: {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
