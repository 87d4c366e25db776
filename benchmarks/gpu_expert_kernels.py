"""Expert kernels on the GPU: per-slot and deduplicating Triton kernels against the alternatives.

One command on a CUDA machine (about 2-4 minutes on an H200; exits 2 without CUDA):

    python benchmarks/gpu_expert_kernels.py --out gpu_expert_kernels.json

It writes the JSON and, beside it, the figure (gpu_expert_kernels.png). Options:
    --trace FILE --trace-shape NAME   also time windows of recorded routing of that model
                                      (a Parquet trace, or a .npy of expert ids [T, L, m] or [T, m])
    --tune                            sweep launch settings; writes a settings table to --out
    --settings FILE                   time with a settings table written by --tune
    --dry-run                         print the plan (ids, bytes, counts); no GPU needed
    --plot FILE.json                  redraw the figure of a results file; no GPU needed

What it measures (seed 000 §2, App. E), on one MoE layer's expert operation with random bf16
weights of the expert shapes of OLMoE-1B-7B, Qwen3-30B-A3B, gpt-oss-20b and DeepSeek-V2-Lite:
the time of each kernel on passes of n = 1..9 tokens whose ids name the fewest (m) or the most
(min(nm, N)) distinct experts, or copy windows of a routing trace. Every run follows an L2 flush
and is timed with CUDA events, replayed from a CUDA graph (`--eager`: launched from Python).
From the medians: the effective bandwidth beta_p(n) = requested bytes / time (per-slot: n m w;
deduplicating kernels: U w), the ratio r(n) = beta_dedup / beta_slot, the byte share
u(n) = U / (n m), each bandwidth as a fraction of the card's measured copy bandwidth, and the
crossover (the smallest n from which the deduplicating kernel stays faster).
"""

import argparse
import importlib.util
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from moespec.bench.gpu_passes import (
    KERNELS,
    distinct_count,
    finish,
    load_trace,
    plan_passes,
    plot,
    requested_bytes,
    summarize,
)
from moespec.bench.gpu_timing import (
    TRITON_KERNELS,
    Timer,
    copy_bandwidth,
    time_shape,
    tune_shape,
)
from moespec.files import atomic_path, check_writable, write_json
from moespec.kernels import ExpertWeights
from moespec.provenance import provenance
from moespec.routing.shapes import SHAPES

SHAPE_NAMES = ("olmoe-1b-7b", "qwen3-30b-a3b", "gpt-oss-20b", "deepseek-v2-lite")
DRY_RUN_DEVICE = "NVIDIA H200"  # whose settings --dry-run compiles


def gpu_machine(device) -> dict:
    import triton

    props = torch.cuda.get_device_properties(device)
    record = provenance(device)
    record["machine"].update(
        sm_count=props.multi_processor_count,
        l2_bytes=getattr(props, "L2_cache_size", None),
        triton=triton.__version__,
    )
    return record


def tune(args, device) -> int:
    from moespec.kernels.triton.settings import shape_key

    check_writable(args.out, force=args.force)
    timer, name = Timer(device), torch.cuda.get_device_name(device)
    table = {"devices": {name: {}}, "measurements": {"machine": gpu_machine(device), "scores": {}}}
    for shape_name in args.shapes:
        shape = SHAPES[shape_name]
        start = time.perf_counter()
        best, scores = tune_shape(shape, timer, device, args)
        key = shape_key(shape.hidden_size, shape.expert_intermediate_size)
        table["devices"][name][key] = best
        table["measurements"]["scores"][shape_name] = scores
        write_json(args.out, table, force=True)
        print(f"{shape_name}: {best} ({time.perf_counter() - start:.0f} s)")
        torch.cuda.empty_cache()
    return 0


def benchmark(args, device) -> int:
    from moespec.kernels.triton.settings import load_table, settings_for

    figure = args.figure or args.out.with_suffix(".png")
    check_writable(args.out, force=args.force)
    check_writable(figure, force=args.force)
    table = load_table(args.settings) if args.settings else None
    trace = load_trace(args.trace, SHAPES[args.trace_shape]) if args.trace else None
    rng, timer, gpu = np.random.default_rng(args.seed), Timer(device), torch.cuda.get_device_name()
    results = {
        "benchmark": "gpu_expert_kernels",
        "complete": False,
        "machine": gpu_machine(device),
        "settings": {
            **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "flush_bytes": timer.flush_bytes,
            "triton": {},
        },
        "copy_bandwidth": copy_bandwidth(timer, device),
        "checks": [],
        "unavailable": {},
        "timings": [],
    }
    print(f"copy bandwidth {results['copy_bandwidth']['bytes_per_s'] / 1e9:.0f} GB/s")
    try:
        for name in args.shapes:
            shape, start = SHAPES[name], time.perf_counter()
            h, i = shape.hidden_size, shape.expert_intermediate_size
            settings = {k: settings_for(k, h, i, gpu, table) for k in TRITON_KERNELS}
            results["settings"]["triton"][name] = {k: asdict(v) for k, v in settings.items()}
            passes = plan_passes(args, shape, rng, trace if name == args.trace_shape else None)
            records, checks, unavailable = time_shape(args, shape, timer, settings, passes, device)
            results["timings"] += records
            results["checks"] += [{"shape": name, **c} for c in checks]
            results["unavailable"][name] = unavailable
            write_json(args.out, results, force=True)  # an interruption keeps finished shapes
            print(
                f"{name}: {len(records)} timings in {time.perf_counter() - start:.0f} s"
                + (f"; unavailable: {unavailable}" if unavailable else "")
            )
            torch.cuda.empty_cache()
        results["complete"] = True
    except KeyboardInterrupt:
        print("interrupted: keeping the shapes measured so far", file=sys.stderr)
    return finish(results, args.out, figure)


def redraw(args) -> int:
    """--plot: the summary and figure of a results file, recomputed from its raw timings."""
    try:
        results = json.loads(args.plot.read_text())
        copy = results["copy_bandwidth"]["bytes_per_s"]
        summary = summarize(results)
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{args.plot}: not a results file of this benchmark ({error})") from None
    figure = args.figure or args.plot.with_suffix(".png")
    with atomic_path(figure, force=args.force) as tmp:
        plot(summary, copy, tmp)
    print(f"wrote {figure}")
    return 0


def dry_run(args) -> int:
    """--dry-run: every pass's ids and bytes, the count of timed runs, and (unless --no-compile)
    every Triton launch of the run compiled for sm_90, all without a GPU."""
    rng = np.random.default_rng(args.seed)
    trace = load_trace(args.trace, SHAPES[args.trace_shape]) if args.trace else None
    runs = 0
    for name in args.shapes:
        shape = SHAPES[name]
        passes = plan_passes(args, shape, rng, trace if name == args.trace_shape else None)
        w = shape.bytes_per_expert
        print(
            f"{name}: H {shape.hidden_size}, I {shape.expert_intermediate_size}, "
            f"N {shape.num_experts}, m {shape.top_k}, w {w / 1e6:.2f} MB, {len(passes)} passes"
        )
        for p in passes:
            if p["ids"] != "trace":
                u = distinct_count(p["expert_ids"])
                slot, dedup = (
                    requested_bytes(k, p["n"], shape.top_k, u, w) / 1e6 for k in KERNELS[:2]
                )
                print(
                    f"  n {p['n']} {p['ids']:6} U {u:3}  u(n) {u / p['expert_ids'].size:.3f}  "
                    f"slot {slot:8.1f} MB  dedup {dedup:7.1f} MB"
                )
            runs += len(args.kernels) * (
                args.repeats if p["ids"] != "trace" else args.window_repeats
            )
        if not args.no_compile:
            print(f"  compiled {compile_check(shape, args, passes)} Triton launches for sm_90")
    print(f"{runs} timed runs")
    return 0


def compile_check(shape, args, passes) -> int:
    """Compile the run's Triton launches for sm_90 (no GPU: meta tensors, real shapes)."""
    from moespec.kernels.triton import launch
    from moespec.kernels.triton.compile import compile_launch
    from moespec.kernels.triton.settings import load_table, settings_for

    table = load_table(args.settings) if args.settings else None
    h, i, e = shape.hidden_size, shape.expert_intermediate_size, shape.num_experts
    meta = torch.device("meta")
    experts = ExpertWeights(
        torch.empty(e, 2 * i, h, dtype=torch.bfloat16, device=meta),
        torch.empty(e, h, i, dtype=torch.bfloat16, device=meta),
    )
    seen, compiled = set(), 0
    for n in sorted({p["n"] for p in passes}):
        x = torch.empty(n, h, dtype=torch.bfloat16, device=meta)
        ids = torch.empty(n, shape.top_k, dtype=torch.long, device=meta)
        weights = torch.empty(n, shape.top_k, device=meta)
        for kernel, plan in (("slot", launch.plan_slot), ("dedup", launch.plan_dedup)):
            if kernel == "dedup" and n == 1:
                continue
            settings = settings_for(kernel, h, i, DRY_RUN_DEVICE, table)
            for one in plan(x, ids, weights, experts, settings)[0]:
                key = (one.kernel, tuple(sorted((k, v) for k, v in one.meta.items())))
                if key not in seen:
                    seen.add(key)
                    compile_launch(one, arch=90)
                    compiled += 1
    return compiled


def _token_range(text: str) -> list[int]:
    """'1-9' or '1,2,4' -> the pass sizes."""
    try:
        if "-" in text:
            first, last = (int(v) for v in text.split("-"))
            values = list(range(first, last + 1))
        else:
            values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a range like 1-9 or a list like 1,2,4: {text!r}"
        ) from None
    if not values or min(values) < 1 or max(values) > 16:
        raise argparse.ArgumentTypeError(f"pass sizes must lie in 1..16: {text!r}")
    return values


def _names(choices):
    def parse(text: str) -> list[str]:
        names = [v.strip() for v in text.split(",") if v.strip()]
        unknown = [v for v in names if v not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {unknown or text!r}; choose from {', '.join(choices)}"
            )
        return names

    return parse


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_expert_kernels", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("gpu_expert_kernels.json"),
        help="results JSON (with --tune: the settings table)",
    )
    parser.add_argument("--figure", type=Path, help="default: --out (or --plot) with .png")
    parser.add_argument(
        "--shapes",
        type=_names(SHAPE_NAMES),
        default=list(SHAPE_NAMES),
        help="comma-separated expert shapes (default: all four)",
    )
    parser.add_argument(
        "--tokens",
        type=_token_range,
        default=list(range(1, 10)),
        help="pass sizes n, e.g. 1-9 (default) or 1,2,4",
    )
    parser.add_argument(
        "--kernels",
        type=_names(KERNELS),
        default=list(KERNELS),
        help="comma-separated kernels to time (default: all)",
    )
    parser.add_argument("--repeats", type=_positive, default=20, help="runs per chosen-ids pass")
    parser.add_argument("--trace", type=Path, help="routing trace: .parquet, or .npy of ids")
    parser.add_argument("--trace-shape", choices=SHAPE_NAMES, help="the model the trace is of")
    parser.add_argument("--windows", type=_positive, default=16, help="trace windows per n")
    parser.add_argument("--window-repeats", type=_positive, default=5, help="runs per window")
    parser.add_argument("--settings", type=Path, help="settings table (from --tune) to time")
    parser.add_argument("--eager", action="store_true", help="launch from Python, no CUDA graph")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="overwrite existing outputs")
    parser.add_argument(
        "--no-compile",
        action="store_true",
        help="with --dry-run: skip compiling the Triton launches",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="plan only; no GPU needed")
    mode.add_argument("--plot", type=Path, metavar="RESULTS", help="redraw a results file")
    mode.add_argument("--tune", action="store_true", help="sweep launch settings")
    args = parser.parse_args(argv)
    if bool(args.trace) != bool(args.trace_shape):
        parser.error("--trace and --trace-shape go together (the trace, and whose routing it is)")
    if args.trace_shape and args.trace_shape not in args.shapes:
        parser.error(f"--trace-shape {args.trace_shape} is not among --shapes")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.plot:
            return redraw(args)
        if args.dry_run:
            return dry_run(args)
        if not torch.cuda.is_available():
            print(
                "gpu_expert_kernels: error: CUDA is not available; this benchmark times GPU "
                "kernels (--dry-run and --plot run without one)",
                file=sys.stderr,
            )
            return 2
        if importlib.util.find_spec("triton") is None:
            print("gpu_expert_kernels: error: Triton is not installed", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        return tune(args, device) if args.tune else benchmark(args, device)
    except (ValueError, OSError) as error:
        print(f"gpu_expert_kernels: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
