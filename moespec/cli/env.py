"""What this machine runs moespec's products with, one fact per line.

The torch version, PyTorch's kernel dispatch level (`ATEN_CPU_CAPABILITY` lowers it), the
CPU's family and flags, oneDNN's instruction limit (`ONEDNN_MAX_CPU_ISA`), whether moespec's
native loops run here (or why not: `moespec.kernels.native`) and whether the native model pass
does (`moespec.kernels.cpu.native_pass_reason`: where it does, the tests assert that decoding
takes it), the product path chosen for bf16, fp32 and int8 weights (moespec.kernels.cpu), the
intra-op threads, and the memory: total and available, and with --model what that model will
hold (its weights in their final layout and its KV cache per position, counted before a byte
is read), with the context that fits beside them, and this process's resident memory after
counting.
"""

import argparse
import json

from moespec.cli.options import add_dtype, add_weights, checkpoint_dir, resolve_weights

HELP = "the CPU capability, the product path chosen per weight format, the threads"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--model",
        metavar="DIR",
        type=checkpoint_dir,
        help="also report the memory this checkpoint or converted directory will take",
    )
    add_dtype(parser)
    add_weights(parser)


def run(args: argparse.Namespace) -> int:
    import torch

    from moespec.kernels.cpu import PATH_REASONS, cpu_paths

    facts = {**cpu_paths().to_dict(), "threads": torch.get_num_threads()}
    facts["memory"] = memory_facts(args.model, args.dtype, resolve_weights(args))
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
        f"native model pass: {facts['native_pass']}",
    ]
    for name, path in facts["paths"].items():
        why = facts["fallbacks"].get(name)
        lines.append(
            f"{name} path: {path} ({PATH_REASONS[path]}" + (f"; fallback: {why})" if why else ")")
        )
    lines.append(f"threads: {facts['threads']}")
    memory = facts["memory"]
    lines.append(
        f"memory: {memory['total_bytes'] / 1e9:.2f} GB, {memory['available_bytes'] / 1e9:.2f} GB "
        "available"
    )
    if "model" in memory:
        m = memory["model"]
        lines.append(
            f"model: {m['weights_bytes'] / 1e9:.3f} GB of {m['weights']} weights"
            f"{' (converted, mapped)' if m['converted'] else ''}, KV cache "
            f"{m['cache_bytes_per_position'] / 1e3:.1f} kB per position; context that fits: "
            + (f"{m['context']} of {m['max_positions']}" if m["context"] else m["refused"])
        )
    lines.append(
        f"resident: {memory['process']['rss'] / 1e9:.3f} GB now, peak "
        f"{memory['process']['peak_rss'] / 1e9:.3f} GB"
    )
    print("\n".join(lines))
    return 0


def memory_facts(model: str | None, dtype: str, weights: str | None) -> dict:
    """The machine's memory and, with a model, what it will take (moespec.models.memory)."""
    import os

    from moespec.models.memory import (
        MemoryRefusal,
        available_memory,
        fit_memory,
        model_footprint,
        process_memory,
    )

    available = available_memory()
    facts = {
        "total_bytes": os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"),
        "available_bytes": available,
    }
    if model is not None:
        footprint = model_footprint(model, dtype, weights)
        facts["model"] = footprint.to_dict()
        try:
            facts["model"]["context"] = fit_memory(footprint, None, available, name=model)
        except MemoryRefusal as refusal:
            facts["model"].update(context=None, refused=str(refusal))
    facts["process"] = process_memory()
    return facts
