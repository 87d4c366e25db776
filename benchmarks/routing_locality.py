"""Benchmark: does the synthetic routing process reproduce a real routing's placement hit rate?

The simulator replays synthetic routing for full-size shapes, fitted to the published rho(2)
and rho(9). Those say how concentrated routing is inside a window, not how well the experts
popular in some documents predict the others' (what a static placement, llama.cpp's or a
profiled one, lives on). This records the one real trained routing moespec can run, the demo
target's on --documents held-out files (the first --fit-share of its tokens the fit part),
measures rho(2), rho(9) and `static_coverage` (the share of the rest's activations that go to
the fit part's hottest quarter of each layer's experts), then fits the synthetic process to the
same rho(2) and rho(9) at each local-popularity share beta of --betas (routing.synthetic),
replays documents of the recorded lengths, and reports each beta's coverage beside the real
one, and the beta whose coverage is nearest.

    python benchmarks/routing_locality.py --out FILE [--documents 40] [--betas 0,0.2,...]
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moespec.cli.options import number_in
from moespec.demo import demo_paths
from moespec.demo.corpus import held_out_documents
from moespec.files import check_writable, write_json
from moespec.models import load_model
from moespec.provenance import provenance  # noqa: E402
from moespec.routing import RoutingTrace, document_statistics, estimate, static_coverage
from moespec.routing.record import record_trace
from moespec.routing.synthetic import LocalityProcess, fit_popularity_skew


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--documents", type=int, default=40)
    parser.add_argument("--max-chars", type=int, default=6000)
    parser.add_argument(
        "--fit-share", type=number_in(0.0, 1.0, low_open=True, high_open=True), default=0.2
    )
    parser.add_argument("--betas", type=_shares, default="0,0.2,0.4,0.6,0.7,0.8,0.9,1")
    parser.add_argument("--fit-tokens", type=int, default=20_000, help="tokens per rho fit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args()
    check_writable(args.out, force=args.force)
    betas = args.betas
    start = time.perf_counter()
    model, tokenizer = load_model(demo_paths()[0], dtype="fp32")
    documents = list(held_out_documents(limit=args.documents, max_chars=args.max_chars))
    trace = record_trace(model, tokenizer, documents, truncate="right")
    fit = int(trace.num_tokens * args.fit_share)
    reuse = estimate(document_statistics(trace, 9), bootstrap=0).reuse_mean
    real = {
        "tokens": trace.num_tokens,
        "documents": trace.num_documents,
        "num_experts": trace.num_experts,
        "top_k": trace.top_k,
        "reuse2": float(reuse[1]),
        "reuse9": float(reuse[8]),
        "static_coverage": static_coverage(trace, fit),
    }
    print(
        f"recorded: {real['tokens']} tokens, {real['documents']} documents; rho(2) "
        f"{real['reuse2']:.3f}, rho(9) {real['reuse9']:.3f}, coverage {real['static_coverage']:.3f}"
    )
    lengths = [int(n) for n in np.diff(trace.doc_starts)]
    rows = []
    for beta in betas:
        skew, curve = fit_popularity_skew(
            trace.num_experts,
            trace.top_k,
            real["reuse2"],
            real["reuse9"],
            tokens=args.fit_tokens,
            seed=args.seed,
            local_popularity=beta,
        )
        process = LocalityProcess(
            trace.num_experts, trace.top_k, popularity_skew=skew, local_popularity=beta
        ).fit(real["reuse2"], tokens=args.fit_tokens, seed=args.seed)
        ids = np.concatenate(list(process.documents(trace.num_layers, lengths, args.seed)))
        synthetic = RoutingTrace(
            ids,
            trace.doc_starts,
            trace.doc_names,
            trace.num_experts,
            list(trace.expert_bytes),
            list(trace.layer_indices),
        )
        row = {
            "local_popularity": beta,
            "popularity_skew": skew,
            "keep_probability": process.p,
            "reuse2": curve[0],
            "reuse9": curve[-1],
            "static_coverage": static_coverage(synthetic, fit),
        }
        rows.append(row)
        print(
            f"beta {beta:.2f}: skew {skew:.3f}, rho(2) {row['reuse2']:.3f}, rho(9) "
            f"{row['reuse9']:.3f}, coverage {row['static_coverage']:.3f}",
            flush=True,
        )
    nearest = min(rows, key=lambda r: abs(r["static_coverage"] - real["static_coverage"]))
    print(f"nearest: beta {nearest['local_popularity']}")
    write_json(
        args.out,
        {
            "benchmark": "synthetic routing against the demo target's recorded routing",
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "recorded": real,
            "synthetic": rows,
            "nearest_local_popularity": nearest["local_popularity"],
            "wall_seconds": time.perf_counter() - start,
            "provenance": provenance(),
        },
        force=args.force,
    )
    return 0


def _shares(text: str) -> list[float]:
    """Comma-separated shares in [0, 1] (argparse names the option on a bad one)."""
    share = number_in(0.0, 1.0)
    values = [share(b.strip()) for b in text.split(",") if b.strip()]
    if not values:
        raise argparse.ArgumentTypeError("names no share")
    return values


_shares.__name__ = "local-popularity shares"


if __name__ == "__main__":
    raise SystemExit(main())
