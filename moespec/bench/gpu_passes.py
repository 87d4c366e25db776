"""Passes, bytes and the summary of the GPU expert-kernel benchmark: everything without a GPU.

The pass plan (chosen ids naming the fewest or the most distinct experts, windows of a routing
trace), the bytes each kernel requests (seed 000 §1: per-slot n m w, deduplicating U w), and
from raw times the effective bandwidths beta_p(n), the ratio r(n), the byte share u(n), the
crossover and the figure. Used by benchmarks/gpu_expert_kernels.py. Ids, windows, bytes,
quartiles and the crossover are the calibration's own (`moespec.calibrate.ids`,
`moespec.calibrate.timing`, `moespec.costmodel.crossover`).
"""

import statistics
from pathlib import Path

import numpy as np

from moespec.calibrate import ids as calibrate_ids
from moespec.calibrate.ids import distinct_count, requested_bytes, window_starts
from moespec.calibrate.timing import quartiles
from moespec.costmodel import crossover as stays_positive_from

__all__ = [
    "CHOSEN",
    "KERNELS",
    "chosen_ids",
    "crossover",
    "distinct_count",
    "finish",
    "load_trace",
    "plan_passes",
    "plot",
    "quartiles",
    "requested_bytes",
    "summarize",
    "trace_windows",
]

KERNELS = ("slot", "dedup", "linear-loop", "grouped_mm", "transformers")
CHOSEN = ("fewest", "most")
TARGET_RATIO, TARGET_COPY_FRACTION = 0.9, 0.7  # the targets, for n = 2..9


def chosen_ids(kind: str, n: int, top_k: int, num_experts: int, rng) -> np.ndarray:
    """Expert ids [n, m] naming the fewest (m) or the most (min(n m, N)) distinct experts:
    the two ends of the calibration's chosen ids (`calibrate.ids.chosen_ids`)."""
    if kind not in CHOSEN:
        raise ValueError(f"unknown id kind {kind!r}; choose one of {CHOSEN}")
    distinct = top_k if kind == "fewest" else min(n * top_k, num_experts)
    return calibrate_ids.chosen_ids(n, top_k, num_experts, distinct, rng)


def load_trace(path: Path, shape) -> tuple[np.ndarray, np.ndarray]:
    """(expert ids [T, L, m], document starts [D + 1]) of a trace file, checked against shape."""
    if path.suffix == ".npy":
        ids = np.load(path)
        ids = ids[:, None, :] if ids.ndim == 2 else ids
        starts = np.array([0, len(ids)])
        if ids.ndim != 3:
            raise ValueError(f"{path}: expert ids must be [T, m] or [T, L, m], got {ids.shape}")
    else:
        from moespec.routing.store import read_trace

        trace = read_trace(path)
        if trace.num_experts != shape.num_experts:
            raise ValueError(
                f"{path}: {trace.num_experts} experts, {shape.name} has {shape.num_experts}"
            )
        ids, starts = trace.expert_ids, trace.doc_starts
    if (
        ids.shape[2] != shape.top_k
        or ids.size
        and not 0 <= ids.min() <= ids.max() < (shape.num_experts)
    ):
        raise ValueError(
            f"{path}: ids must be top-{shape.top_k} of {shape.num_experts} experts ({shape.name})"
        )
    return ids, starts


def trace_windows(ids: np.ndarray, starts: np.ndarray, n: int, count: int, rng) -> list[dict]:
    """Up to `count` windows of n consecutive tokens of one layer, never across a document
    boundary: [{"layer", "start", "ids" [n, m]}], each on a layer drawn uniformly, its starts
    drawn as the calibration draws its recorded windows (`calibrate.ids.window_starts`)."""
    layers = rng.integers(ids.shape[1], size=count)
    windows = []
    for layer in sorted(set(layers.tolist())):
        for start in window_starts(starts, n, int((layers == layer).sum()), rng):
            windows.append(
                {"layer": layer, "start": int(start), "ids": ids[start : start + n, layer]}
            )
    return windows


def plan_passes(args, shape, rng, trace=None) -> list[dict]:
    """Every pass to time for one shape: {"ids" kind, "n", "window", "expert_ids" [n, m]}."""
    passes = []
    for n in args.tokens:
        for kind in CHOSEN:
            ids = chosen_ids(kind, n, shape.top_k, shape.num_experts, rng)
            passes.append({"ids": kind, "n": n, "window": None, "expert_ids": ids})
        if trace is not None:
            for window in trace_windows(*trace, n, args.windows, rng):
                ids = window.pop("ids")
                passes.append({"ids": "trace", "n": n, "window": window, "expert_ids": ids})
    return passes


def crossover(savings: dict[int, float]) -> int | None:
    """The smallest pass size n >= 2 from which the deduplicating kernel stays faster: the
    cost model's crossover over the passes of more than one token."""
    passes = {n: s for n, s in savings.items() if n >= 2}
    return stays_positive_from(passes) if passes else None


def _point(records: list[dict], copy: float) -> dict:
    """One (shape, ids, n, kernel): times and bytes summed over windows (seed 000 Table 1)."""
    medians = [statistics.median(r["times_us"]) for r in records]
    total_bytes = sum(r["bytes"] for r in records)
    bandwidth = total_bytes / (sum(medians) * 1e-6)
    # The spread: over the repeats of one pass, or over the windows of recorded routing.
    if len(records) == 1:
        samples = [records[0]["bytes"] / (t * 1e-6) for t in records[0]["times_us"]]
    else:
        samples = [r["bytes"] / (m * 1e-6) for r, m in zip(records, medians, strict=True)]
    q1, _, q3 = quartiles(samples)
    return {
        "time_us": sum(medians),
        "bytes": total_bytes,
        "bandwidth": bandwidth,
        "bandwidth_iqr": [q1, q3],
        "copy_fraction": bandwidth / copy,
        "windows": len(records),
    }


def summarize(results: dict) -> dict:
    """beta_p(n), r(n), u(n), copy fractions, savings, crossovers and targets, from raw times."""
    copy = results["copy_bandwidth"]["bytes_per_s"]
    groups: dict = {}
    for r in results["timings"]:
        groups.setdefault((r["shape"], r["ids"], r["n"]), {}).setdefault(r["kernel"], []).append(r)
    summary: dict = {}
    for (shape, ids, n), kernels in sorted(groups.items()):
        entry = {name: _point(records, copy) for name, records in kernels.items()}
        slot_records = kernels.get("slot") or next(iter(kernels.values()))
        entry["byte_share"] = sum(r["distinct"] for r in slot_records) / sum(
            r["slots"] for r in slot_records
        )
        if "slot" in entry and "dedup" in entry:
            entry["bandwidth_ratio"] = entry["dedup"]["bandwidth"] / entry["slot"]["bandwidth"]
            entry["saving_us"] = entry["slot"]["time_us"] - entry["dedup"]["time_us"]
        summary.setdefault(shape, {}).setdefault(ids, {"points": {}})["points"][n] = entry
    for kinds in summary.values():
        for series in kinds.values():
            _judge(series)
    return summary


def _judge(series: dict) -> None:
    """The crossover and the issue's targets over n = 2..9 of one (shape, ids) series."""
    points = series["points"]
    savings = {n: p["saving_us"] for n, p in points.items() if "saving_us" in p}
    series["crossover"] = crossover(savings)
    targeted = [p for n, p in points.items() if 2 <= n <= 9 and "bandwidth_ratio" in p]
    if targeted:
        series["min_bandwidth_ratio"] = min(p["bandwidth_ratio"] for p in targeted)
        series["min_slot_copy_fraction"] = min(p["slot"]["copy_fraction"] for p in targeted)
        series["targets_met"] = {
            f"r(n) >= {TARGET_RATIO}": series["min_bandwidth_ratio"] >= TARGET_RATIO,
            f"slot >= {TARGET_COPY_FRACTION} of copy": (
                series["min_slot_copy_fraction"] >= TARGET_COPY_FRACTION
            ),
        }


COLORS = {"fewest": "tab:blue", "most": "tab:orange", "trace": "tab:green"}
ALTERNATIVES = {"linear-loop": "x:", "grouped_mm": "^:", "transformers": "v:"}


def _draw_series(beta, ratio, fraction, ids: str, series: dict, alternatives: bool) -> None:
    """One (shape, ids) series: its bandwidths, r(n), u(n) and crossover."""
    ns = sorted(series["points"])
    points = [series["points"][n] for n in ns]
    color = COLORS[ids]

    def line(ax, key, style, label, value="bandwidth", scale=1.0, **kwargs):
        if all(key in p for p in points):
            ys = [(p[key][value] if value else p[key]) * scale for p in points]
            ax.plot(ns, ys, style, label=f"{label}, {ids}", **kwargs)

    for kernel, style in (("slot", "-o"), ("dedup", "--s")):
        line(beta, kernel, style, kernel, scale=1e-9, color=color)  # GB/s
        line(fraction, kernel, style, kernel, value="copy_fraction", color=color)
    if alternatives:  # the other kernels, on the ids of the real routing where there are some
        for kernel, style in ALTERNATIVES.items():
            line(beta, kernel, style, kernel, scale=1e-9, color="grey")
    line(ratio, "bandwidth_ratio", "-o", "r(n)", value=None, color=color)
    line(ratio, "byte_share", ":", "ū(n)", value=None, color=color)
    if series.get("crossover"):
        ratio.axvline(series["crossover"], color=color, alpha=0.3, lw=4)


def plot(summary: dict, copy_bandwidth: float, path: Path) -> None:
    """Rows: beta_p(n) (GB/s); r(n) and u(n) with the crossovers; fraction of the copy bandwidth.
    A column per shape. Dashed lines: the targets r(n) = 0.9 and 0.7 of the copy bandwidth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(summary)
    fig, axes = plt.subplots(3, len(shapes), figsize=(4.2 * len(shapes), 10), squeeze=False)
    for col, shape in enumerate(shapes):
        beta, ratio, fraction = (axes[row][col] for row in range(3))
        main = "trace" if "trace" in summary[shape] else "most"
        for ids, series in summary[shape].items():
            _draw_series(beta, ratio, fraction, ids, series, alternatives=ids == main)
        beta.axhline(copy_bandwidth / 1e9, color="grey", ls=":", label="copy")
        ratio.axhline(TARGET_RATIO, color="black", ls="--", lw=0.8)
        fraction.axhline(TARGET_COPY_FRACTION, color="black", ls="--", lw=0.8)
        beta.set_title(shape)
        beta.set_ylabel("β_p(n), GB/s")
        ratio.set_ylabel("r(n) (solid), ū(n) (dotted)")
        fraction.set_ylabel("fraction of copy bandwidth")
        fraction.set_xlabel("tokens per pass n")
        for ax in (beta, ratio, fraction):
            ax.grid(alpha=0.3)
            ax.xaxis.get_major_locator().set_params(integer=True)
    axes[0][0].legend(fontsize=6)
    axes[1][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def finish(results: dict, out: Path, figure: Path) -> int:
    """Summarise, write the JSON and the figure, print the headline numbers; 0 when the run
    completed, 130 when it was interrupted (the shapes measured so far are kept)."""
    from moespec.files import atomic_path, write_json

    results["summary"] = summarize(results) if results["timings"] else {}
    write_json(out, results, force=True)
    if results["summary"]:
        with atomic_path(figure, force=True) as tmp:
            plot(results["summary"], results["copy_bandwidth"]["bytes_per_s"], tmp)
    for shape, kinds in results["summary"].items():
        for ids, series in kinds.items():
            ratios = " ".join(
                f"{p.get('bandwidth_ratio', float('nan')):.2f}"
                for _, p in sorted(series["points"].items())
            )
            print(
                f"{shape:18} {ids:7} r(n) {ratios}  crossover {series.get('crossover')}  "
                f"targets {series.get('targets_met')}"
            )
    print(f"wrote {out} and {figure}")
    return 0 if results["complete"] else 130
