"""Consecutive-token reuse of a routing trace: rho(n), U(n) and u(n) for n = 1..--max-n.

Prints the layer means of the reuse rho(n) (the share of a token's experts that one of the
n - 1 tokens before it also selected), the distinct experts U(n) of n consecutive tokens, the
distinct share U/(n m) and the byte share u(n) (the bytes a deduplicating pass reads over
those a per-slot pass reads), with percentile intervals from bootstrap resamples of documents
(of blocks of tokens inside them when there are fewer than 5 documents). Against them:
independent uniform routing (1 - q^(n-1), N (1 - q^n), q = 1 - m/N) and random pairing, the
same estimator on each layer's tokens in a random order (expert popularity without temporal
locality). --split picks the fit or test documents (by a hash of their names) or all of them.
--plot draws reuse against n with those baselines.
"""

import argparse
import json

from moespec.cli.options import non_negative_int, number_in, positive_int

HELP = "reuse rho(n), union U(n) and byte share u(n) of a routing trace, with intervals"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", metavar="TRACE", help="trace file (.parquet)")
    parser.add_argument("--max-n", type=positive_int, default=9, metavar="N", help="largest n (9)")
    parser.add_argument(
        "--bootstrap",
        type=non_negative_int,
        default=2000,
        metavar="B",
        help="resamples (2000; 0: none)",
    )
    parser.add_argument(
        "--block-tokens",
        type=positive_int,
        metavar="N",
        help="with fewer than 5 documents, the bootstrap resamples blocks of N tokens inside "
        "them (default: the larger of 4 x --max-n and the cube root of the tokens)",
    )
    parser.add_argument("--seed", type=int, default=0, help="bootstrap and shuffle seed (0)")
    parser.add_argument("--split", default="all", choices=["fit", "test", "all"])
    parser.add_argument(
        "--fit-fraction",
        type=number_in(0, 1),
        default=0.5,
        metavar="F",
        help="share of documents the hash puts in the fit part (0.5)",
    )
    parser.add_argument(
        "--confidence",
        type=number_in(0, 1, low_open=True, high_open=True),
        default=0.95,
        help="interval level (0.95)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", metavar="FILE.png", help="draw reuse against n to a PNG file")
    parser.add_argument("--force", action="store_true", help="overwrite an existing --plot file")


def run(args: argparse.Namespace) -> int:
    from moespec.files import check_writable
    from moespec.routing.reuse import reuse_report, split_trace
    from moespec.routing.store import read_trace

    if args.plot:
        check_writable(args.plot, force=args.force)
    from moespec.progress import Progress, show_progress

    with Progress(show_progress(quiet=args.json)) as progress:
        progress.start(f"reading {args.trace}")
        trace = split_trace(read_trace(args.trace), args.split, args.fit_fraction)
        report = reuse_report(
            trace,
            max_n=args.max_n,
            bootstrap=args.bootstrap,
            seed=args.seed,
            confidence=args.confidence,
            block_tokens=args.block_tokens,
            progress=progress,
        )
    if args.json:
        print(json.dumps({"trace": str(args.trace), "split": args.split, **report.to_dict()}))
    else:
        print(format_report(report, args.trace, args.split))
    if args.plot:
        from moespec.report.reuse import plot_reuse

        plot_reuse(report, args.plot, force=args.force)
        if not args.json:
            print(f"wrote {args.plot}")
    return 0


def format_report(report, trace_name: str, split: str) -> str:
    measured, shuffled, uniform = report.measured, report.random_pairing, report.uniform
    lines = [
        f"{trace_name}: {report.model or 'unnamed model'}, {report.num_layers} MoE layers, "
        f"{report.num_experts} experts, top-{report.top_k}; {report.num_documents} documents "
        f"({split}), {report.num_tokens} tokens",
    ]
    if report.bootstrap:
        lines.append(
            f"layer means; {report.confidence:.0%} intervals from {report.bootstrap} bootstrap "
            f"resamples of {report.resampling} (seed {report.seed})"
        )
    elif report.no_interval:
        lines.append(f"layer means; no intervals: {report.no_interval}")
    else:
        lines.append("layer means; no bootstrap")
    lines.append(
        f"{'n':>2}  {'reuse rho(n)':<22} {'random':>6} {'uniform':>7}  "
        f"{'union U(n)':<24} {'uniform':>7}  {'U/(nm)':>6}  byte share u(n)"
    )
    for i in range(report.max_n):
        lines.append(
            f"{i + 1:>2}  {_with_interval(measured, 'reuse_mean', i, 3):<22} "
            f"{_number(shuffled.reuse_mean[i], 3):>6} {uniform['reuse'][i]:>7.3f}  "
            f"{_with_interval(measured, 'union_mean', i, 2):<24} {uniform['union'][i]:>7.2f}  "
            f"{_number(measured.distinct_share_mean[i], 3):>6}  "
            f"{_with_interval(measured, 'byte_share', i, 3)}"
        )
    return "\n".join(lines)


def _number(value, digits: int) -> str:
    return "n/a" if value != value else f"{value:.{digits}f}"  # NaN: no window that long


def _with_interval(estimate, name: str, i: int, digits: int) -> str:
    text = _number(getattr(estimate, name)[i], digits)
    if name in estimate.intervals:
        low, high = estimate.intervals[name][:, i]
        text += f" [{_number(low, digits)}, {_number(high, digits)}]"
    return text
