"""Benchmark: how long the reuse analysis of a trace of 10^6 token-layer rows takes.

A synthetic OLMoE-1B-7B trace (16 MoE layers, 64 experts, top-8, rho(2) fitted to 0.363) of
62,500 tokens in 100 documents is written to Parquet, read back, and analysed as `moespec reuse`
does: rho(n), U(n), u(n) for n = 1..9 with 2000 bootstrap resamples, for the trace and for its
random-pairing baseline. Writes JSON with each stage's wall time, the settings, the machine and
the versions.

    python benchmarks/reuse_speed.py --out reuse_speed.json [--force]
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--tokens", type=int, default=62_500)
    parser.add_argument("--documents", type=int, default=100)
    parser.add_argument("--bootstrap", type=int, default=2000)
    parser.add_argument("--max-n", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=3, help="analyses timed (the best kept)")
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args()

    from moespec.files import check_writable, write_json
    from moespec.provenance import provenance
    from moespec.routing.reuse import reuse_report
    from moespec.routing.shapes import get_shape
    from moespec.routing.store import read_trace, write_trace
    from moespec.routing.synthetic import LocalityProcess, synthetic_trace

    check_writable(args.out, force=args.force)
    shape = get_shape("olmoe-1b-7b")
    timings = {}
    started = time.perf_counter()
    process = LocalityProcess(shape.num_experts, shape.top_k).fit(shape.published_reuse2)
    timings["fit_seconds"] = time.perf_counter() - started
    started = time.perf_counter()
    trace = synthetic_trace(
        process,
        num_layers=shape.num_layers,
        tokens=args.tokens,
        documents=args.documents,
        expert_bytes=shape.expert_bytes,
        model=shape.name,
    )
    timings["generate_seconds"] = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.parquet"
        started = time.perf_counter()
        write_trace(trace, path)
        timings["write_seconds"] = time.perf_counter() - started
        file_bytes = path.stat().st_size
        started = time.perf_counter()
        trace = read_trace(path)
        timings["read_seconds"] = time.perf_counter() - started
    analyses = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        report = reuse_report(trace, max_n=args.max_n, bootstrap=args.bootstrap, seed=0)
        analyses.append(time.perf_counter() - started)
    timings["analysis_seconds"] = analyses
    result = {
        "benchmark": "reuse analysis of a synthetic trace",
        "settings": {
            "shape": shape.name,
            "token_layer_rows": trace.num_tokens * trace.num_layers,
            "tokens": trace.num_tokens,
            "documents": trace.num_documents,
            "max_n": args.max_n,
            "bootstrap": args.bootstrap,
            "random_pairing": True,
            "target_reuse2": shape.published_reuse2,
        },
        "file_bytes": file_bytes,
        "timings": timings,
        "best_analysis_seconds": min(analyses),
        "measured_reuse2": float(report.measured.reuse_mean[1]),
        "load_average": os.getloadavg(),
        "provenance": provenance(),
    }
    write_json(args.out, result, force=args.force)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
