"""Benchmark: the simulator's calibration gate in seed 003's setting (sim.calibration).

Qwen3-30B-A3B shapes, synthetic routing at rho(2) = 0.48 and rho(9) = 0.78 with each document's
popularity the share --local-popularity its own (one request of 512 tokens after a fit split of
--fit-documents others), an RTX 4090 on PCIe 4.0 (profile rtx4090-avx2 unless --profile), batch
1, k = 8, a = 0.73, a 25% cache, llama.cpp as whole-layer static placement. Prints every figure
beside the paper's and writes them as JSON; exits 1 when a check is missed (the JSON is written
first). The gate runs at --draft-stop S (the simulator's reading of llama.cpp's confidence
stop; 0: every step drafts k), or by default at the recall fitted to Table 1's llama.cpp
sd_ratio (`fit_draft_stop`; sd_ratio is then marked fitted); the two checks that drafting
decides are also run at each stop recall of the sweep (`stop_sweep` in the JSON).

    python benchmarks/calibration_gate.py --out FILE [--tokens 512] [--profile NAME]
        [--draft-stop S|fit]
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moespec.cli.options import number_in
from moespec.files import check_writable, write_json
from moespec.offload import get_profile
from moespec.offload.sim.calibration import (
    FIT_DOCUMENTS,
    FIT_TOKENS,
    GATE_PROFILE,
    LLAMACPP,
    LOCAL_POPULARITY,
    PAPER_SPAC,
    PAPER_STATIC_SD,
    fit_draft_stop,
    gate,
    gate_workload,
    stop_sweep,
)
from moespec.provenance import provenance  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--profile", default=GATE_PROFILE)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--fit-tokens", type=int, default=FIT_TOKENS)
    parser.add_argument("--fit-documents", type=int, default=FIT_DOCUMENTS)
    parser.add_argument(
        "--local-popularity", type=number_in(0.0, 1.0), default=LOCAL_POPULARITY, metavar="B"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--draft-stop", type=_stop, default="fit", metavar="S|fit")
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args()
    check_writable(args.out, force=args.force)
    profile = get_profile(args.profile)
    workload = gate_workload(
        args.tokens + 9,
        fit_tokens=args.fit_tokens,
        fit_documents=args.fit_documents,
        local_popularity=args.local_popularity,
        seed=args.seed,
    )
    start = time.perf_counter()
    fit = None
    if args.draft_stop == "fit":
        fit = fit_draft_stop(workload, profile, tokens=args.tokens, seed=args.seed)
        stop = fit["draft_stop"]
        print(f"draft stop fitted to llama.cpp's sd_ratio {fit['target']:.3f}: recall {stop:.4f}")
    else:
        stop = args.draft_stop
    result = gate(
        workload,
        profile,
        tokens=args.tokens,
        seed=args.seed,
        draft_stop=stop,
        fitted=fit is not None,
    )
    sweep = stop_sweep(
        workload, profile, tokens=args.tokens, seed=args.seed, done={stop: result["runs"]}
    )
    spac = result["runs"]["spac@8"]["tokens_per_second"]
    headline = {
        "spac_tokens_per_second": spac,
        "spac_over_llamacpp_sd": spac / result["runs"][LLAMACPP[0]]["tokens_per_second"],
        "paper_spac_tokens_per_second": PAPER_SPAC,
        "paper_spac_over_llamacpp_sd": PAPER_SPAC / PAPER_STATIC_SD,
    }
    seconds = time.perf_counter() - start
    for name, check in result["checks"].items():
        if name != "met":
            print(f"{name:<14} {_fmt(check['value']):>28}  paper {_fmt(check['paper']):>14}  "
                  f"{'met' if check['met'] else 'MISSED'}")  # fmt: skip
    print(f"gate at draft stop {stop:.4f}: {'met' if result['checks']['met'] else 'missed'}")
    over, paper = headline["spac_over_llamacpp_sd"], headline["paper_spac_over_llamacpp_sd"]
    print(f"SpAc (k = 8) {spac:.2f} tokens/s, {over:.3f}x llama.cpp with speculation "
          f"(paper {PAPER_SPAC}, {paper:.3f}x)")  # fmt: skip
    print("draft stop  sd_ratio  spac tokens/s at gamma 2, 4, 6, 8   both met")
    for row in sweep:
        by_gamma = ", ".join(f"{v:.1f}" for v in row["spac_tokens_per_second_by_gamma"].values())
        verdicts = (row["sd_ratio_met"], row["gamma_rising_met"])
        print(f"{row['draft_stop']:>10.2f}  {row['sd_ratio']:>8.3f}  {by_gamma:>32}   "
              f"{'yes' if all(verdicts) else 'no'}")  # fmt: skip
    print(f"({seconds:.0f} s)")
    write_json(
        args.out,
        {
            "benchmark": "simulator calibration gate, seed 003 setting",
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "workload": workload.name,
            "profile": profile.to_dict(),
            "draft_stop": stop,
            "draft_stop_fit": fit,
            **result,
            "headline": headline,
            "stop_sweep": sweep,
            "wall_seconds": seconds,
            "provenance": provenance(),
        },
        force=args.force,
    )
    return 0 if result["checks"]["met"] else 1


def _stop(text: str):
    return "fit" if text == "fit" else number_in(0.0, 1.0)(text)


_stop.__name__ = "draft stop (a recall in [0, 1], or fit)"


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, list | tuple):
        return "(" + ", ".join(_fmt(v) for v in value) + ")"
    return str(value)


if __name__ == "__main__":
    raise SystemExit(main())
