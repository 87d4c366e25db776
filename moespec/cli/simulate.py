"""Simulate offloaded-expert scheduling policies on a routing trace and a hardware profile.

Replays a recorded trace (--trace FILE) or a synthetic one of a built-in model shape
(--synthetic MODEL, fitted to the shape's published rho(2) or --reuse2, each document's expert
popularity the share --local-popularity its own) through each policy
(spac, lru, static, static-layers (llama.cpp's whole-layer placement), hybrid, spac-ar;
baselines without speculation as lru-ar, static-ar, static-layers-ar, hybrid-ar; SpAc ablations
as spac-no-estimator, spac-fixed-bounds, spac-static-tau, spac-no-prefetch, spac-no-evict,
spac-no-sd, spac-literal-delta, spac-release, spac-count-adaptive, spac-level), with
speculative steps of --draft-length k at geometric --acceptance a, under one cache budget
(--expert-cache-ratio of all expert bytes), on a hardware profile (rtx4090-pcie4, rtx4090-avx2,
a100-pcie4, this-machine, or a JSON file).
Prints tokens/s, latency per token, cache hit rate, hot/cold accuracy (beside that of the
forecast "active in the previous pass"), frequency sMAPE and
bytes copied per policy. --report DIR also simulates the comparisons of the MoE-SpAc paper
(tokens/s per workload and policy, SpAc with one part removed at a time, tokens/s against the
cache size and against the draft length) and writes them as Markdown, PNG and JSON; an
interrupted report writes nothing.
"""

import argparse
import json
import sys

from moespec.cli.options import number_in

HELP = "simulate expert offloading policies (MoE-SpAc and baselines) on a hardware profile"
DEFAULT_POLICIES = "spac,lru,static,static-layers,hybrid,spac-ar"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", metavar="FILE", help="a routing trace (Parquet)")
    source.add_argument("--synthetic", metavar="MODEL", help="a built-in model shape")
    parser.add_argument(
        "--profile",
        default="rtx4090-pcie4",
        metavar="NAME",
        help="rtx4090-pcie4 (default), a100-pcie4, this-machine, or FILE.json",
    )
    parser.add_argument("--expert-cache-ratio", type=float, default=0.25, metavar="R")
    parser.add_argument("--draft-length", type=int, default=8, metavar="K")
    parser.add_argument("--acceptance", type=float, default=0.7, metavar="A")
    parser.add_argument(
        "--draft-stop",
        type=number_in(0.0, 1.0),
        default=0.0,
        metavar="S",
        help="after the first rejected draft, the chance drafting stops short of K (llama.cpp's"
        " --draft-p-min stop; default 0: every step drafts K)",
    )
    parser.add_argument(
        "--policy",
        default=DEFAULT_POLICIES,
        metavar="P1,P2,...",
        help=f"policies to compare (default: {DEFAULT_POLICIES})",
    )
    parser.add_argument(
        "--reuse2",
        type=float,
        metavar="RHO",
        help="target rho(2) of the synthetic trace (default: the shape's)",
    )
    parser.add_argument(
        "--local-popularity",
        type=number_in(0.0, 1.0),
        default=0.0,
        metavar="B",
        help="synthetic: the share of each document's expert popularity that is its own "
        "(0: one popularity for the whole trace; the demo target's recorded routing is "
        "reproduced near 0.8, benchmarks/routing_locality.py)",
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=2048,
        metavar="N",
        help="tokens to generate per simulation (default 2048)",
    )
    parser.add_argument(
        "--fit-tokens",
        type=int,
        default=512,
        metavar="N",
        help="synthetic: tokens of the fit split before the replay (default 512)",
    )
    parser.add_argument(
        "--fit-documents",
        type=int,
        default=1,
        metavar="N",
        help="synthetic: requests the fit split is made of, each of its own popularity "
        "(default 1; the calibration gate profiles on 4)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object by policy")
    parser.add_argument("--report", metavar="DIR", help="write the report's tables and figures")
    parser.add_argument("--force", action="store_true", help="overwrite existing report files")


def run(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from moespec.offload import make_policy
    from moespec.offload.sim.experiments import simulation
    from moespec.offload.sim.hardware import get_profile
    from moespec.progress import Progress, show_progress
    from moespec.report.offload import check_report_dir, write_report

    names = [n.strip() for n in args.policy.split(",") if n.strip()]
    if not names:
        raise ValueError("--policy names no policy")
    for name in names:
        make_policy(name)  # unknown names fail here, before any long work
    if args.report:
        check_report_dir(args.report, force=args.force)
    profile = get_profile(args.profile)
    with Progress(show_progress(quiet=args.json)) as progress:
        try:
            run = simulation(
                names,
                profile,
                trace=args.trace,
                synthetic=args.synthetic,
                cache_ratio=args.expert_cache_ratio,
                draft_length=args.draft_length,
                acceptance=args.acceptance,
                draft_stop=args.draft_stop,
                tokens=args.tokens,
                fit_tokens=args.fit_tokens,
                fit_documents=args.fit_documents,
                reuse2=args.reuse2,
                local_popularity=args.local_popularity,
                seed=args.seed,
                report=bool(args.report),
                progress=progress,
            )
            if args.report:
                progress.start(f"writing the report to {args.report}")
                paths = write_report(args.report, run.report, force=args.force)
        except KeyboardInterrupt:
            if args.report:
                progress.close()
                print(f"interrupted: nothing written to {args.report}", file=sys.stderr)
            raise
    if args.json:
        print(json.dumps(run.results, indent=2))
    else:
        print(format_results(run.results, run.workload.name, profile.name, asdict(run.settings)))
    if args.report and not args.json:
        print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


def format_results(results: dict, workload: str, profile: str, settings: dict) -> str:
    lines = [
        f"workload {workload} on {profile}: cache ratio {settings['cache_ratio']}, draft length "
        f"{settings['draft_length']}, acceptance {settings['acceptance']}"
        + (f", draft stop {settings['draft_stop']}" if settings.get("draft_stop") else ""),
        f"{'policy':<20} {'tok/s':>8} {'ms/tok':>8} {'hit':>6} {'acc':>6} {'acc0':>6} "
        f"{'sMAPE':>6} {'GB copied':>9} {'CPU exp.':>9}",
    ]
    for name, r in results.items():
        acc, acc0 = r["hot_cold_accuracy"], r["previous_pass_hot_cold_accuracy"]
        lines.append(
            f"{name:<20} {r['tokens_per_second']:>8.2f} {r['latency_per_token_ms']:>8.1f} "
            f"{r['hit_rate']:>6.3f} {_fmt(acc):>6} {_fmt(acc0):>6} "
            f"{r['frequency_smape']:>6.3f} {r['bytes_copied'] / 1e9:>9.2f} {r['cpu_experts']:>9}"
        )
    lines.append(
        "acc: the policy's hot/cold forecast (tau = 1); acc0: the forecast 'hot = active in the "
        "previous pass' on the same passes"
    )
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"
