"""Benchmark: the simulator's calibration gate in seed 003's setting (sim.calibration).

Qwen3-30B-A3B shapes, synthetic routing at rho(2) = 0.48, the RTX 4090 + PCIe 4.0 + AMX host
profile, batch 1, k = 8, a = 0.73, a 25% cache. Prints every figure beside the paper's and
writes them as JSON; exits 1 when a check is missed (the JSON is written first).

    python benchmarks/calibration_gate.py --out FILE [--tokens 512] [--profile NAME]
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moespec.files import check_writable, write_json
from moespec.offload import get_profile
from moespec.offload.sim.calibration import gate
from moespec.offload.sim.workload import synthetic_workload
from moespec.provenance import provenance  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--profile", default="rtx4090-pcie4")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--fit-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args()
    check_writable(args.out, force=args.force)
    profile = get_profile(args.profile)
    workload = synthetic_workload(
        "qwen3-30b-a3b",
        tokens=args.tokens + 9,
        fit_tokens=args.fit_tokens,
        reuse2=0.48,
        seed=args.seed,
    )
    start = time.perf_counter()
    result = gate(workload, profile, tokens=args.tokens, seed=args.seed)
    seconds = time.perf_counter() - start
    for name, check in result["checks"].items():
        if name != "met":
            print(f"{name:<14} {_fmt(check['value']):>28}  paper {_fmt(check['paper']):>14}  "
                  f"{'met' if check['met'] else 'MISSED'}")  # fmt: skip
    print(f"gate: {'met' if result['checks']['met'] else 'missed'} ({seconds:.0f} s)")
    write_json(
        args.out,
        {
            "benchmark": "simulator calibration gate, seed 003 setting",
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "workload": workload.name,
            "profile": profile.to_dict(),
            **result,
            "wall_seconds": seconds,
            "provenance": provenance(),
        },
        force=args.force,
    )
    return 0 if result["checks"]["met"] else 1


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, list | tuple):
        return "(" + ", ".join(_fmt(v) for v in value) + ")"
    return str(value)


if __name__ == "__main__":
    raise SystemExit(main())
