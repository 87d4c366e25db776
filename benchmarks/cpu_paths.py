"""The candidate product paths for one decode-sized product, timed side by side in one process.

    python benchmarks/cpu_paths.py --out benchmarks/results/cpu_paths_avx512.json
    python benchmarks/cpu_paths.py --avx2 --out benchmarks/results/cpu_paths_avx2.json

A [2048, 2048] weight (an OLMoE expert's gate or up half; bf16 values) times 1 row, over a
set of such weights larger than the last-level cache, for each path: bf16 `F.linear`
(unpacked), bf16 packed for oneDNN (where it packs), bf16 as a torch.compile'd reduction, an
fp32 upcast (`F.linear` and packed),
int8 with one scale per output channel (`torch._weight_int8pack_mm`, and the same math as a
torch.compile'd reduction), and 32-weight blocks with a scale each (Q8_0's layout) as a
torch.compile'd reduction (PyTorch has no fused kernel for them); and, as a lead, fbgemm's
W8A8 dynamic product (activations quantized too). Rounds interleave the paths,
each warmed alike; the JSON keeps every round, the medians and each path's speed over the
bf16 unpacked path's, paired per round. --before-rev REV also times the native pair loops
built from native.c as of the git revision REV, beside this tree's, in the same rounds: a
change to the loops measured before and after in one process. --avx2 re-runs the script with
ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2, which lower the dispatch to AVX2 on an
AVX-512 machine: how `moespec.kernels.cpu`'s AVX2 choice was measured here.
"""

import argparse
import functools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from moespec.bench.stats import ratio_range
from moespec.calibrate.timing import beyond_last_level_cache
from moespec.files import write_json
from moespec.kernels import native
from moespec.kernels.cpu import cpu_paths, onednn_packs
from moespec.kernels.quant import quantize_int8
from moespec.provenance import provenance

AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}

OUT, IN, BLOCK = 2048, 2048, 32
# moespec's native loops, each where the CPU has it: on the pair layout (the paths
# moespec.kernels.cpu chooses from) and row by row (candidates)
NATIVE_PAIRS = {"moespec_bf16_pairs": "avx512_bf16", "moespec_bf16_pairs_avx2": "avx2"}
NATIVE_INT8_PAIRS = {
    "moespec_int8_pairs_vnni": "avx512_vnni",
    "moespec_int8_pairs_avx512": "avx512bw",
    "moespec_int8_pairs_avx2": "avx2",
}
NATIVE_BF16 = {"moespec_bf16_avx2": "avx2"}
NATIVE_INT8 = {"moespec_int8_avx512": "avx512bw", "moespec_int8_avx2": "avx2"}


def blocks(weight: torch.Tensor):
    """Q8_0's layout: int8 values and one bf16 scale per 32 consecutive weights of a row."""
    w = weight.float().view(OUT, IN // BLOCK, BLOCK)
    scales = w.abs().amax(-1) / 127
    values = torch.round(w / scales[..., None].clamp_min(1e-30)).clamp(-127, 127)
    return values.to(torch.int8), scales.to(torch.bfloat16)


def bf16_reduction(x, weight):
    return (weight.float() * x.float()).sum(-1).to(x.dtype)[None]


def channel_reduction(x, values, scales):
    return ((values.float() * x.float()).sum(-1) * scales.float()).to(x.dtype)[None]


def block_reduction(x, values, scales):
    parts = (values.float() * x.float().view(IN // BLOCK, BLOCK)).sum(-1)
    return (parts * scales.float()).sum(-1).to(x.dtype)[None]


def before_library(rev: str):
    """The native library built (as the engine builds its own) from native.c as of git
    revision `rev` with this tree's step.c, in a temporary folder."""
    folder = Path(tempfile.mkdtemp(prefix="moespec-before-"))
    done = subprocess.run(
        ["git", "show", f"{rev}:moespec/kernels/native.c"],
        cwd=Path(__file__).resolve().parent,
        capture_output=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"--before-rev {rev}: no moespec/kernels/native.c there (git show failed)")
    (folder / "native.c").write_bytes(done.stdout)
    shutil.copy(native.SOURCES[1], folder / "step.c")
    path, _ = native.build(native.find_compiler(), folder, (folder / "native.c", folder / "step.c"))
    return native.load(path)


def candidates(weights: list[torch.Tensor], rows: int = 1, before=None) -> dict:
    """{path: (product of weight i, bytes it reads)}; `before`: another build's library, whose
    pair loops are timed too."""
    x = torch.randn(rows, IN).bfloat16()
    xf = x.float()
    fp32 = [w.float() for w in weights]
    int8 = [quantize_int8(w) for w in weights]
    rows8 = [q.rows() for q in int8]  # [out, in] values, whatever layout moespec holds
    q8_0 = [blocks(w) for w in weights]
    paths = {
        "bf16 F.linear": (lambda i: F.linear(x, weights[i]), OUT * IN * 2),
        "fp32 upcast F.linear": (lambda i: F.linear(xf, fp32[i]), OUT * IN * 4),
        "int8 channel _weight_int8pack_mm": (
            lambda i: torch._weight_int8pack_mm(x, rows8[i], int8[i].scales),
            int8[0].nbytes,
        ),
    }
    if onednn_packs(torch.bfloat16):
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
        paths["bf16 oneDNN packed"] = (lambda i: onednn(x, packed[i]), OUT * IN * 2)
    if onednn_packs(torch.float32):
        packed32 = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in fp32]
        paths["fp32 upcast oneDNN packed"] = (lambda i: onednn(xf, packed32[i]), OUT * IN * 4)
    if "fbgemm" in torch.backends.quantized.supported_engines:
        packs = dynamic_int8(weights)
        paths["W8A8 dynamic quantized.linear_dynamic"] = (
            lambda i: torch.ops.quantized.linear_dynamic(xf, packs[i], True),
            OUT * IN + OUT * 8,
        )
    flags = set(cpu_paths().flags)
    for function, flag in NATIVE_PAIRS.items():
        if native.native().has(function) and flag in flags:
            pairs = [native.pack_pairs(w) for w in weights]
            paths[f"bf16 native {function.removeprefix('moespec_bf16_')}"] = (
                functools.partial(
                    lambda i, f, p: native.native_product(f, p[i], x, OUT), f=function, p=pairs
                ),
                OUT * IN * 2,
            )
    for function, flag in NATIVE_INT8_PAIRS.items():
        if native.native().has(function) and flag in flags:
            groups = [native.pack_pairs(r) for r in rows8]
            paths[f"int8 native {function.removeprefix('moespec_int8_')}"] = (
                functools.partial(
                    lambda i, f, g: native.native_product(f, g[i], x, OUT, int8[i].scales),
                    f=function,
                    g=groups,
                ),
                int8[0].nbytes,
            )
    for function, flag in {**NATIVE_PAIRS, **NATIVE_INT8_PAIRS}.items():
        if before is None or not hasattr(before, function) or flag not in flags:
            continue
        kind = "bf16" if "bf16" in function else "int8"
        laid = [native.pack_pairs(w) for w in (weights if kind == "bf16" else rows8)]
        paths[f"{kind} native {function.removeprefix(f'moespec_{kind}_')} (before)"] = (
            functools.partial(
                lambda i, f, p, s: native._call(f, p[i], x, OUT, s[i] if s else None),
                f=getattr(before, function),
                p=laid,
                s=[q.scales for q in int8] if kind == "int8" else None,
            ),
            OUT * IN * 2 if kind == "bf16" else int8[0].nbytes,
        )
    for function, flag in NATIVE_BF16.items():
        if native.native().has(function) and flag in flags:
            paths[f"bf16 native {function.removeprefix('moespec_bf16_')}"] = (
                functools.partial(
                    lambda i, f: native.native_product(f, weights[i], x, OUT), f=function
                ),
                OUT * IN * 2,
            )
    for function, flag in NATIVE_INT8.items():
        if native.native().has(function) and flag in flags:
            paths[f"int8 native {function.removeprefix('moespec_int8_')}"] = (
                functools.partial(
                    lambda i, f: native.native_product(f, rows8[i], x, OUT, int8[i].scales),
                    f=function,
                ),
                int8[0].nbytes,
            )
    if rows > 1:  # the reductions below are one-row products
        return paths
    reduction = torch.compile(bf16_reduction, dynamic=False)
    paths["bf16 torch.compile"] = (lambda i: reduction(x[0], weights[i]), OUT * IN * 2)
    channel = torch.compile(channel_reduction, dynamic=False)
    block = torch.compile(block_reduction, dynamic=False)
    paths["int8 channel torch.compile"] = (
        lambda i: channel(x[0], rows8[i], int8[i].scales),
        int8[0].nbytes,
    )
    paths["int8 Q8_0 blocks torch.compile"] = (
        lambda i: block(x[0], *q8_0[i]),
        OUT * IN + q8_0[0][1].nbytes,
    )
    return paths


def dynamic_int8(weights: list[torch.Tensor]) -> list:
    """fbgemm's prepacked int8 weights (one scale per output channel) for
    `quantized.linear_dynamic`, which also quantizes the activations (per tensor, per call):
    W8A8, not weight-only; timed as a lead, not a moespec path."""
    packs = []
    for w in weights:
        w = w.float()
        scales = (w.abs().amax(1) / 127).double()
        zeros = torch.zeros(OUT, dtype=torch.long)
        q = torch.quantize_per_channel(w, scales, zeros, 0, torch.qint8)
        packs.append(torch.ops.quantized.linear_prepack(q, None))
    return packs


def onednn(x, packed):
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [None], "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--weights",
        type=int,
        default=None,
        help="distinct weights cycled (default: 24, or more where the bf16 set would not exceed "
        "twice the last-level cache)",
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, default=1, help="rows per product (a pass of n)")
    parser.add_argument("--note", default="")
    parser.add_argument("--avx2", action="store_true", help="lower the dispatch to AVX2")
    parser.add_argument("--before-rev", help="a git revision whose native pair loops are timed too")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    if args.avx2 and any(os.environ.get(k) != v for k, v in AVX2.items()):
        # both are read when torch loads: run this script again with them set
        command = [sys.executable, __file__, *(sys.argv[1:] if argv is None else argv)]
        os.execve(sys.executable, command, {**os.environ, **AVX2})
    if args.out.exists() and not args.force:
        parser.error(f"{args.out} exists (use --force)")
    before = before_library(args.before_rev) if args.before_rev else None
    torch.set_num_threads(args.threads)
    if args.weights is None:
        bf16_bytes = OUT * IN * 2
        args.weights = max(24, -(-beyond_last_level_cache(0) // bf16_bytes))
    generator = torch.Generator().manual_seed(0)
    weights = [
        (torch.randn(OUT, IN, generator=generator) * 0.02).bfloat16() for _ in range(args.weights)
    ]
    paths = candidates(weights, args.rows, before)
    samples = {name: [] for name in paths}
    with torch.inference_mode():
        for product, _ in paths.values():  # compile and warm every path alike
            for i in range(len(weights)):
                product(i)
        for _ in range(args.rounds):
            for name, (product, _) in paths.items():
                start = time.perf_counter()
                for i in range(len(weights)):
                    product(i)
                samples[name].append((time.perf_counter() - start) / len(weights))
    base = samples["bf16 F.linear"]
    results = {}
    for name, seconds in samples.items():
        ratios = sorted(b / s for b, s in zip(base, seconds, strict=True))
        median = statistics.median(seconds)
        results[name] = {
            "seconds": seconds,
            "median_seconds": median,
            "bytes": paths[name][1],
            "bytes_per_second": paths[name][1] / median,
            "bf16_equivalent_bytes_per_second": OUT * IN * 2 / median,
            "speed_over_bf16_linear": ratio_range(ratios),
        }
        r = results[name]
        print(
            f"{name:34s} {median * 1e6:8.1f} us  {r['bytes_per_second'] / 1e9:5.1f} GB/s  "
            f"x{r['speed_over_bf16_linear']['median']:.2f} of bf16 F.linear"
        )
    report = {
        "benchmark": "cpu_paths",
        "provenance": provenance(settings={"threads": args.threads}),
        "cpu": cpu_paths().to_dict(),
        "settings": {
            **vars(args),
            "out": str(args.out),
            "shape": [OUT, IN],
        },
        "results": results,
    }
    write_json(args.out, report, force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
