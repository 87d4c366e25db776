"""The fixed time of a decode step, eager against the compiled step, paired in one process.

    python benchmarks/captured_step.py --out benchmarks/results/captured_step.json

For each model of the embedded demo pair and each thread count, one worker process loads the
model (bf16, packed as `moespec generate` loads it), compiles its one-token step
(moespec.models.compiled) and warms both arms; then, in --rounds rounds with the order
alternating, times greedy plain decoding of --tokens tokens by each arm: (time of N + 1
tokens - time of 1 token) / N, the median of --repeats, in wall time and in the process's
CPU time (less disturbed by other work on a shared machine). The paired ratio is per round.
Fixed time = step time - B / beta as in benchmarks/fixed_time.py (B the bytes of a step,
beta the best read bandwidth measured here). With --profile, one profile of 20 steps of
each arm: library operations per step and the self time of the largest ones.
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
sys.path.insert(0, str(HERE))

from fixed_time import PROMPT, read_bandwidths, step_bytes  # noqa: E402

from moespec.bench.stats import ratio_range  # noqa: E402


def timed(run, n) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    run(n)
    return time.perf_counter() - wall, time.process_time() - cpu


def per_token(run, tokens: int, repeats: int) -> tuple[float, float]:
    """Median over repeats of (run(N + 1) - run(1)) / N: (wall, CPU) seconds per token."""
    walls, cpus = [], []
    for _ in range(repeats):
        long, short = timed(run, tokens + 1), timed(run, 1)
        walls.append((long[0] - short[0]) / tokens)
        cpus.append((long[1] - short[1]) / tokens)
    return statistics.median(walls), statistics.median(cpus)


def profile_steps(model, prompt, steps: int = 20) -> dict:
    """Library operations per one-token step and the self time of the largest ones."""
    import torch
    from torch.profiler import profile

    cache = model.new_cache(capacity=len(prompt) + steps + 1)
    model(torch.tensor(prompt), cache)
    start = time.perf_counter()
    with profile() as prof:
        for _ in range(steps):
            model(torch.tensor([5]), cache)
    wall = (time.perf_counter() - start) / steps
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]
    return {
        "aten_ops_per_step": sum(e.count for e in events) / steps,
        "profiled_ms_per_step": wall * 1e3,
        "top_self_ms_per_step": {e.key[:60]: e.self_cpu_time_total / 1e3 / steps for e in top},
    }


def worker(args) -> int:
    import torch

    from moespec.decoding import KernelPolicy, generate
    from moespec.models import load_model
    from moespec.models.compiled import capture, compile_report

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model_dir, dtype="bf16")
    prompt = tokenizer.encode(PROMPT)

    def run(n):
        for _ in generate(model, prompt, max_tokens=n, kernels=KernelPolicy("slot")):
            pass

    start = time.perf_counter()
    capture(model, "on")
    step = model.captured_step
    run(2)  # compiles
    compile_seconds = time.perf_counter() - start
    arms = {"eager": None, "compiled": step}
    for use in arms.values():  # warm both alike
        model.captured_step = use
        run(1), run(args.tokens + 1)
    samples = {name: [] for name in arms}
    for round_ in range(args.rounds):
        order = list(arms) if round_ % 2 == 0 else list(arms)[::-1]
        for name in order:
            model.captured_step = arms[name]
            samples[name].append(per_token(run, args.tokens, args.repeats))
    profiles = {}
    if args.profile:
        for name, use in arms.items():
            model.captured_step = use
            profiles[name] = profile_steps(model, prompt)
    model.captured_step = step
    out = {
        "samples": samples,
        "compile_seconds": compile_seconds,
        "compile": compile_report(model),
        "profiles": profiles,
    }
    print(json.dumps(out))
    return 0


def spawn(model_dir, threads, args) -> dict:
    env = dict(os.environ, PYTHONPATH=str(HERE.parent), OMP_NUM_THREADS=str(threads))
    command = [sys.executable, str(Path(__file__).resolve()), "--worker"]
    command += ["--model-dir", str(model_dir), "--threads", str(threads)]
    command += ["--tokens", str(args.tokens), "--repeats", str(args.repeats)]
    command += ["--rounds", str(args.rounds)] + (["--profile"] if args.profile else [])
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"worker failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(measured: dict, nbytes: int, beta: float) -> dict:
    """ms per token (wall and CPU), fixed ms, per arm; the compiled speedup per round."""
    out = {}
    for name, samples in measured["samples"].items():
        wall = [w for w, _ in samples]
        cpu = [c for _, c in samples]
        out[name] = {
            "ms_per_token": [w * 1e3 for w in wall],
            "cpu_ms_per_token": [c * 1e3 for c in cpu],
            "median_ms_per_token": statistics.median(wall) * 1e3,
            "median_cpu_ms_per_token": statistics.median(cpu) * 1e3,
            "tokens_per_second": 1 / statistics.median(wall),
            "bytes_ms": nbytes / beta * 1e3,
            "fixed_ms": (statistics.median(wall) - nbytes / beta) * 1e3,
            "fixed_ms_cpu": (statistics.median(cpu) - nbytes / beta) * 1e3,
        }
    for clock, index in (("wall", 0), ("cpu", 1)):
        ratios = [
            e[index] / c[index]
            for e, c in zip(
                measured["samples"]["eager"], measured["samples"]["compiled"], strict=True
            )
        ]
        out[f"compiled_speedup_paired_{clock}"] = ratio_range(ratios)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.threads = int(args.threads)
        return worker(args)
    if args.out is None:
        parser.error("--out is required")
    from moespec.demo import demo_paths
    from moespec.files import check_writable, write_json
    from moespec.provenance import provenance

    check_writable(args.out, force=args.force)
    threads = [int(t) for t in args.threads.split(",")]
    demo = dict(zip(("target", "draft"), map(str, demo_paths()), strict=True))
    load = {"start": os.getloadavg()}
    bandwidth = {t: read_bandwidths(t) for t in threads}
    results = {}
    for name, directory in demo.items():
        nbytes = step_bytes(directory, depth=6 + args.tokens // 2)
        for t in threads:
            measured = spawn(directory, t, args)
            summary = summarize(measured, nbytes, max(bandwidth[t].values()))
            summary.update({k: measured[k] for k in ("compile_seconds", "compile", "profiles")})
            summary["bytes_per_step"] = nbytes
            results[f"{name}/{t}"] = summary
            e, c = summary["eager"], summary["compiled"]
            paired = summary["compiled_speedup_paired_wall"]
            print(
                f"{name} {t} thr: eager {e['median_ms_per_token']:.3f} ms (cpu "
                f"{e['median_cpu_ms_per_token']:.3f}) compiled {c['median_ms_per_token']:.3f} ms "
                f"(cpu {c['median_cpu_ms_per_token']:.3f}); fixed {e['fixed_ms']:.3f} -> "
                f"{c['fixed_ms']:.3f} ms; x{paired['median']:.2f} "
                f"({paired['min']:.2f}-{paired['max']:.2f})",
                flush=True,
            )
    load["end"] = os.getloadavg()
    report = {
        "benchmark": "captured_step",
        "provenance": provenance(),
        "settings": {
            "tokens": args.tokens,
            "repeats": args.repeats,
            "rounds": args.rounds,
            "threads": threads,
            "prompt": PROMPT,
            "dtype": "bf16",
            "batch": 1,
            "kernel": "slot",
            "models": {name: "moespec/demo/" + name for name in demo},
        },
        "load_average_1_5_15_min": load,  # other work on the machine while it ran
        "read_bandwidth_bytes_per_second": {str(t): b for t, b in bandwidth.items()},
        "results": results,
    }
    write_json(args.out, report, force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
