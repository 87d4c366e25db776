"""What this machine runs moespec's products with, one fact per line.

The torch version, PyTorch's kernel dispatch level (`ATEN_CPU_CAPABILITY` lowers it), the
CPU's family and flags, oneDNN's instruction limit (`ONEDNN_MAX_CPU_ISA`), whether moespec's
native loops run here (or why not: `moespec.kernels.native`), the product path
chosen for bf16, fp32 and int8 weights (moespec.kernels.cpu), and the intra-op threads.
"""

import argparse
import json

HELP = "the CPU capability, the product path chosen per weight format, the threads"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    import torch

    from moespec.kernels.cpu import PATH_REASONS, cpu_paths

    facts = {**cpu_paths().to_dict(), "threads": torch.get_num_threads()}
    if args.json:
        print(json.dumps(facts))
        return 0
    flags = " ".join(facts["flags"]) or "none read"
    lines = [
        f"torch: {facts['torch']}",
        f"cpu capability: {facts['capability']} (family {facts['family']}; flags {flags})",
        f"onednn max isa: {facts['onednn_max_isa'] or 'not limited'}",
        f"native loops: {facts['native']}"
        + "".join(f"; {k} {f}" for k, f in facts["native_functions"].items() if f),
    ]
    for name, path in facts["paths"].items():
        why = facts["fallbacks"].get(name)
        lines.append(
            f"{name} path: {path} ({PATH_REASONS[path]}" + (f"; fallback: {why})" if why else ")")
        )
    lines.append(f"threads: {facts['threads']}")
    print("\n".join(lines))
    return 0
