"""Passes, bytes and the summary of the GPU expert-kernel benchmark: everything without a GPU.

The pass plan (chosen ids naming the fewest or the most distinct experts, windows of a routing
trace), the bytes each kernel requests (seed 000 §1: per-slot n m w, deduplicating U w), and
from raw times the effective bandwidths beta_p(n), the ratio r(n), the byte share u(n), the
crossover and the figure. Used by gpu_expert_kernels.py.
"""

import statistics
from pathlib import Path

import numpy as np

KERNELS = ("slot", "dedup", "linear-loop", "grouped_mm", "transformers")
CHOSEN = ("fewest", "most")
TARGET_RATIO, TARGET_COPY_FRACTION = 0.9, 0.7  # the targets, for n = 2..9


def chosen_ids(kind: str, n: int, top_k: int, num_experts: int, rng) -> np.ndarray:
    """Expert ids [n, m] naming the fewest (m) or the most (min(n m, N)) distinct experts."""
    order = rng.permutation(num_experts)
    if kind == "fewest":
        return np.tile(order[:top_k], (n, 1))
    if kind == "most":  # consecutive slots cycle through a permutation: a row never repeats
        return order[np.arange(n * top_k) % num_experts].reshape(n, top_k)
    raise ValueError(f"unknown id kind {kind!r}; choose one of {CHOSEN}")


def distinct_count(ids: np.ndarray) -> int:
    """U: the distinct experts a pass names."""
    return len(np.unique(ids))


def requested_bytes(kernel: str, n: int, top_k: int, distinct: int, expert_bytes: int) -> int:
    """E_p(n): per-slot reads n m experts; every other kernel reads each distinct expert once."""
    return (n * top_k if kernel == "slot" else distinct) * expert_bytes


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
    """`count` windows of n consecutive tokens of one layer, never across a document boundary:
    [{"layer", "start", "ids" [n, m]}], drawn uniformly over (layer, start)."""
    valid = np.concatenate(
        [np.arange(a, b - n + 1) for a, b in zip(starts[:-1], starts[1:], strict=True)]
    )
    if not len(valid):
        raise ValueError(f"no document of the trace has {n} tokens")
    windows = []
    for _ in range(count):
        start, layer = int(rng.choice(valid)), int(rng.integers(ids.shape[1]))
        windows.append({"layer": layer, "start": start, "ids": ids[start : start + n, layer]})
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


def quartiles(samples: list[float]) -> tuple[float, float, float]:
    if len(samples) == 1:
        return samples[0], samples[0], samples[0]
    q1, q2, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return q1, q2, q3


def crossover(savings: dict[int, float]) -> int | None:
    """The smallest pass size n >= 2 from which the deduplicating kernel stays faster."""
    found = None
    for n in sorted((n for n in savings if n >= 2), reverse=True):
        if savings[n] <= 0:
            break
        found = n
    return found


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
