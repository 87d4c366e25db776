"""Benchmark: MoE-SpAc vs the baselines in the offload simulator, Qwen3-30B-A3B shapes.

Synthetic routing fitted to rho(2) = 0.48 (48 MoE layers, 128 experts, top-8), the RTX 4090 +
PCIe 4.0 profile, a 25% expert cache, k = 8, a = 0.7. Writes headline.json (tokens/s, latency,
hit rate, accuracy, bytes moved per policy, with the wall time of each simulation, machine and
versions) and, unless --no-report, the Table 1 / Table 2 / Figure 5 report into --out.

    python benchmarks/simulate_offload.py --out DIR [--tokens 2048] [--report-tokens 1024]
"""

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from moespec.offload import get_profile
from moespec.offload.sim.experiments import run_policy, settings_for
from moespec.offload.sim.workload import synthetic_workload

POLICIES = ["spac", "lru", "static", "hybrid", "spac-ar", "lru-ar", "static-ar", "hybrid-ar"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--profile", default="rtx4090-pcie4")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--report-tokens", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-report", action="store_true")
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from moespec.files import check_writable, write_json

    check_writable(args.out / "headline.json", force=args.force)
    import numpy

    from moespec import __version__

    profile = get_profile(args.profile)
    start = time.perf_counter()
    workload = synthetic_workload(args.model, tokens=args.tokens + 9, reuse2=0.48, seed=args.seed)
    build_seconds = time.perf_counter() - start
    settings = settings_for(
        workload,
        cache_ratio=0.25,
        draft_length=8,
        acceptance=0.7,
        tokens=args.tokens,
        seed=args.seed,
    )
    results = {}
    for name in POLICIES:
        start = time.perf_counter()
        results[name] = run_policy(workload, name, profile, settings)
        results[name]["simulation_wall_seconds"] = time.perf_counter() - start
        r = results[name]
        print(
            f"{name:10s} {r['tokens_per_second']:7.2f} tok/s  hit {r['hit_rate']:.3f}  "
            f"{r['simulation_wall_seconds']:.1f} s",
            file=sys.stderr,
        )
    best = max(v["tokens_per_second"] for k, v in results.items() if not k.startswith("spac"))
    spac = results["spac"]["tokens_per_second"]
    summary = {
        "spac_over_best_baseline": spac / best,
        "spac_over_lru": spac / results["lru"]["tokens_per_second"],
        "spac_ar_over_best_baseline": results["spac-ar"]["tokens_per_second"] / best,
    }
    write_json(
        args.out / "headline.json",
        {
            "model": args.model,
            "profile": profile.to_dict(),
            "workload": workload.name,
            "trace_metadata": workload.trace.metadata,
            "settings": vars(settings),
            "workload_build_seconds": build_seconds,
            "results": results,
            "summary": summary,
            "machine": {
                "python": platform.python_version(),
                "processor": platform.processor(),
                "platform": platform.platform(),
            },
            "versions": {"moespec": __version__, "numpy": numpy.__version__},
        },
        force=args.force,
    )
    print(json.dumps(summary, indent=2))
    if not args.no_report:
        from moespec.cli import main as cli

        return cli(
            [
                "simulate",
                "--synthetic",
                args.model,
                "--reuse2",
                "0.48",
                "--profile",
                args.profile,
                "--policy",
                ",".join(POLICIES[:5]),
                "--tokens",
                str(args.report_tokens),
                "--seed",
                str(args.seed),
                "--report",
                str(args.out / "report"),
                *(["--force"] if args.force else []),
            ]
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
