"""The offload report: seed 003 Table 1 / Table 2 / Figure 5 analogues as Markdown, PNG, JSON.

`write_report(directory, data)` takes the dict the `simulate --report` command assembles
(settings, profile, workload, table1, table2, figure5, draft_length rows) and writes
report.md, report.json, table1.png, table2.png, figure5.png and draft-length.png.
"""

from pathlib import Path

from moespec.files import atomic_path, check_writable, publish_files, write_json

FILES = ["report.md", "report.json", "table1.png", "table2.png", "figure5.png", "draft-length.png"]
BASELINE_PREFIXES = ("lru", "static", "hybrid")


def check_report_dir(directory, *, force: bool) -> Path:
    """Refuse early when the directory's report files exist (without force) or it cannot be
    made; nothing is created until the report is written."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"{directory} is not a directory (for the report)")
    if directory.is_dir():
        for name in FILES:
            check_writable(directory / name, force=force)
    elif not directory.absolute().parent.is_dir():
        raise FileNotFoundError(
            f"directory {directory.parent} does not exist (for the report {directory})"
        )
    return directory


def write_report(directory, data: dict, *, force: bool = False) -> list[Path]:
    """Write every file of the report together (moespec.files.publish_files): an
    interruption leaves the directory as it was."""
    directory = Path(directory)
    with publish_files(directory, FILES, force=force) as staging:
        _write_files(staging, data)
    return [directory / name for name in FILES]


def _write_files(directory: Path, data: dict, force: bool = False) -> None:
    write_json(directory / "report.json", data, force=force)
    _bars(
        data["table1"],
        "workload",
        directory / "table1.png",
        force,
        "Tokens/s per workload (acceptance) and policy",
    )
    _bars(
        [{**r, "workload": "ablation"} for r in data["table2"]],
        "workload",
        directory / "table2.png",
        force,
        "SpAc with one part removed at a time: tokens/s",
    )
    _lines(
        data["figure5"],
        "cache_ratio",
        directory / "figure5.png",
        force,
        "Tokens/s vs expert cache ratio",
    )
    _lines(
        data["draft_length"],
        "draft_length",
        directory / "draft-length.png",
        force,
        "Tokens/s vs draft length k",
    )
    with atomic_path(directory / "report.md", force=force) as tmp:
        tmp.write_text(markdown(data))


def _policies(rows) -> list[str]:
    return list(dict.fromkeys(r["policy"] for r in rows))


def _fmt(value, digits=2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def markdown(data: dict) -> str:
    s, w = data["settings"], data["workload"]
    lines = [
        "# Offloaded experts: simulated scheduling",
        "",
        "The comparisons of the MoE-SpAc paper (Li et al., 2026), simulated on this trace "
        "and hardware profile: tokens/s per workload and policy, SpAc with one part removed at "
        "a time, and tokens/s against the expert cache size and against the draft length.",
        "",
        f"Workload: {w['name']} ({w['layers']} MoE layers, {w['experts']} experts, top-"
        f"{w['top_k']}, frequency sMAPE {_fmt(w.get('smape'), 3)}). Profile: "
        f"{data['profile']['name']} ({data['profile'].get('note', '')}).",
        f"Settings: cache ratio {s['cache_ratio']}, draft length {s['draft_length']}, "
        f"acceptance {s['acceptance']}, {s['tokens']} tokens, seed {s['seed']}"
        + (f", draft stop {s['draft_stop']:.4g}" if s.get("draft_stop") else "")
        + (
            f", each document's popularity {local:g} its own"
            if (local := (w.get("metadata") or {}).get("local_popularity"))
            else ""
        )
        + ". Policies ending in -ar decode without speculation.",
        "",
        "## Tokens/s (latency per token, ms) per workload and policy",
        "",
        *_table1(data["table1"]),
        "",
        "## SpAc with one part removed at a time",
        "",
        "| variant | tokens/s | latency (ms/token) | hit rate | hot/cold accuracy "
        "| previous-pass forecast | GB copied |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in data["table2"]:
        lines.append(
            f"| {r['policy']} | {r['tokens_per_second']:.2f} | {r['latency_per_token_ms']:.1f} | "
            f"{r['hit_rate']:.3f} | {_fmt(r['hot_cold_accuracy'], 3)} | "
            f"{_fmt(r.get('previous_pass_hot_cold_accuracy'), 3)} | "
            f"{r['bytes_copied'] / 1e9:.1f} |"
        )
    lines += [
        "",
        "Hot/cold accuracy: the share of experts a policy forecast right as active or not "
        "(utility >= 1 for SpAc), averaged over layers. Previous-pass forecast: "
        "the same score for the forecast 'hot = active in the previous pass', on the same passes.",
    ]
    lines += ["", "![ablations](table2.png)", "", "## Tokens/s against the expert cache size", ""]
    lines += _pivot(data["figure5"], "cache_ratio")
    lines += ["", "![cache ratio](figure5.png)", "", "## Tokens/s vs draft length", ""]
    lines += _pivot(data["draft_length"], "draft_length")
    lines += ["", "![draft length](draft-length.png)", ""]
    return "\n".join(lines)


def _table1(rows) -> list[str]:
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    cell = {(r["policy"], r["workload"]): r for r in rows}
    head = "| policy | " + " | ".join(
        f"{w} (a={cell[(rows[0]['policy'], w)]['acceptance']})" for w in workloads
    )
    lines = [head + " |", "| --- |" + " --- |" * len(workloads)]
    for p in _policies(rows):
        cells = [
            f"{cell[(p, w)]['tokens_per_second']:.2f} ({cell[(p, w)]['latency_per_token_ms']:.1f})"
            for w in workloads
        ]
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    # SpAc against the baselines of its own decoding mode, and against the autoregressive
    # ones, apart: a "best" over both modes would mix two questions.
    for label, autoregressive in (("speculative", False), ("autoregressive", True)):
        gains = []
        for w in workloads:
            spac = cell.get(("spac", w))
            base = [
                cell[(p, w)]["tokens_per_second"]
                for p in _policies(rows)
                if p.startswith(BASELINE_PREFIXES) and p.endswith("-ar") == autoregressive
            ]
            gain = f"{spac['tokens_per_second'] / max(base) - 1:+.1%}" if spac and base else "–"
            gains.append(gain)
        lines.append(f"| SpAc vs best {label} baseline | " + " | ".join(gains) + " |")
    return lines + ["", "![table 1](table1.png)"]


def _pivot(rows, key: str) -> list[str]:
    values = list(dict.fromkeys(r[key] for r in rows))
    cell = {(r["policy"], r[key]): r["tokens_per_second"] for r in rows}
    lines = [
        "| policy | " + " | ".join(f"{key} {v}" for v in values) + " |",
        "| --- |" + " --- |" * len(values),
    ]
    for p in _policies(rows):
        lines.append(f"| {p} | " + " | ".join(f"{cell[(p, v)]:.2f}" for v in values) + " |")
    return lines


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, plt, path, force) -> None:
    fig.tight_layout()
    with atomic_path(path, force=force) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def _bars(rows, key, path, force, title) -> None:
    plt = _figure()
    groups = list(dict.fromkeys(r[key] for r in rows))
    policies = _policies(rows)
    tps = {(r["policy"], r[key]): r["tokens_per_second"] for r in rows}
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(groups) * len(policies) / 3), 4), dpi=120)
    width = 0.8 / len(policies)
    for i, p in enumerate(policies):
        xs = [g + i * width for g in range(len(groups))]
        ax.bar(xs, [tps.get((p, g), 0) for g in groups], width, label=p)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], groups)
    ax.set_ylabel("tokens/s")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    _save(fig, plt, path, force)


def _lines(rows, key, path, force, title) -> None:
    plt = _figure()
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for p in _policies(rows):
        points = [(r[key], r["tokens_per_second"]) for r in rows if r["policy"] == p]
        ax.plot(*zip(*points, strict=True), marker="o", label=p)
    ax.set_xlabel(key.replace("_", " "))
    if key == "draft_length":
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("tokens/s")
    ax.set_title(title)
    ax.legend(fontsize=7)
    _save(fig, plt, path, force)
