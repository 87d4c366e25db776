"""The plan's report: Markdown with the numbers, and four figures (PNG).

bandwidth.png  effective bandwidth of each kernel against n (per-slot on n m b, dedup on U b)
ratio.png      r(n) against u(n): deduplication is faster where u < r (eq. 7)
saving.png     S(n) of each version, the measured saving, and the band of bound (18)
               (user-facing titles and labels say these in words; the equations stay here)
staircase.png  k_hat*(a) from V_hat(k), with its step points
"""

from pathlib import Path

from moespec.files import atomic_path
from moespec.plan import Plan

# The three prediction versions, as a reader of the figure would name them.
LABELS = {
    "prediction": "predicted from the fits",
    "measured_time": "from the timed windows",
    "calibrated": "calibrated on whole passes",
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    from matplotlib.ticker import MaxNLocator

    for ax in fig.axes:  # every figure's x axis is a pass size: whole tokens
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    with atomic_path(path, force=True) as tmp:
        fig.savefig(tmp, format="png", dpi=120)


def write_report(plan: Plan, out_dir: Path) -> list[Path]:
    """Write report.md and the figures beside plan.json; return the paths written."""
    out_dir = Path(out_dir)
    plt = _pyplot()
    written = []
    n_values = list(range(1, len(plan.predictions["calibrated"].saving) + 1))

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for kernel, table in plan.bandwidth.items():
        ns = sorted(table)
        ax.plot(ns, [table[n] / 1e9 for n in ns], "o-", label=kernel)
    ax.axhline(plan.read_bandwidth / 1e9, ls=":", color="grey", label="read bandwidth")
    ax.set(
        xlabel="tokens per pass n",
        ylabel="effective bandwidth (GB/s)",
        title="Expert operation alone, recorded windows",
    )
    ax.legend()
    fig.tight_layout()
    _save(fig, out_dir / "bandwidth.png")
    plt.close(fig)
    written.append(out_dir / "bandwidth.png")

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    share = plan.routing.byte_share
    ax.plot(n_values[1:], share[1 : len(n_values)], "s--", label="byte share u(n)")
    for kernel, table in plan.bandwidth_ratio.items():
        ns = sorted(n for n in table if n >= 2)
        ax.plot(ns, [table[n] for n in ns], "o-", label=f"bandwidth ratio r(n), {kernel}")
    ax.set(
        xlabel="tokens per pass n",
        ylabel="ratio",
        title="Deduplication pays where its byte share\nis below its bandwidth ratio",
    )
    ax.legend()
    fig.tight_layout()
    _save(fig, out_dir / "ratio.png")
    plt.close(fig)
    written.append(out_dir / "ratio.png")

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    measured = plan.measured_verify
    dedup = plan.kernel.dedup_kernel
    if "slot" in measured and dedup in measured:
        saving = [(a - b) * 1e3 for a, b in zip(measured["slot"], measured[dedup], strict=True)]
        ax.plot(n_values, saving, "ko-", label="measured")
    for name, style in (("prediction", "r-"), ("measured_time", "C7--"), ("calibrated", "b-.")):
        version = plan.predictions[name]
        ax.plot(n_values, [s * 1e3 for s in version.saving], style, label=LABELS[name])
        if name == "prediction" and version.saving_bound is not None:
            pairs = list(zip(version.saving, version.saving_bound, strict=True))
            low = [(s - b) * 1e3 for s, b in pairs]
            high = [(s + b) * 1e3 for s, b in pairs]
            ax.fill_between(n_values, low, high, color="r", alpha=0.15, label="bound from epsilon")
    ax.axhline(0, color="grey", lw=0.6)
    ax.set(
        xlabel="tokens per pass n",
        ylabel="saving S(n) (ms)",
        title="Time deduplication saves per verify pass",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, out_dir / "saving.png")
    plt.close(fig)
    written.append(out_dir / "saving.png")

    from moespec.report.staircase import plot_staircase

    plot_staircase(plan.step_times, str(out_dir / "staircase.png"), force=True)
    written.append(out_dir / "staircase.png")

    with atomic_path(out_dir / "report.md", force=True) as tmp:
        tmp.write_text(markdown(plan))
    written.append(out_dir / "report.md")
    return written


def _ms(value) -> str:
    return "-" if value is None else f"{value * 1e3:.3f}"


def markdown(plan: Plan) -> str:
    model, made = plan.model, plan.provenance
    calibrated = plan.predictions["calibrated"]
    dedup = plan.kernel.dedup_kernel
    lines = [
        f"# Plan for {model.name} ({model.model_type}, {plan.dtype}, {made.device})",
        "",
        f"Made by moespec {made.versions['moespec']} (torch {made.versions['torch']}, "
        f"{made.threads} threads) in {plan.seconds:.0f} s. Machine read bandwidth "
        f"{plan.read_bandwidth / 1e9:.1f} GB/s. CPU capability {made.cpu_capability or '-'}; "
        f"commit {made.commit or '-'}.",
        "",
        f"**Kernel switch**: per-slot below n = {plan.kernel.crossover}, {dedup} from it."
        if plan.kernel.crossover
        else "**Kernel switch**: none; the per-slot kernel is faster (or as fast) at every n.",
        "",
        f"Bandwidth error epsilon = {plan.bandwidth_error:.3f} (median relative error of the "
        "fits on recorded windows; the larger kernel's).",
        "",
        "## Fits: time of the expert operation against the bytes it reads",
        "",
        "| kernel | t_op (ms) | cost per first/union byte (s/GB) | re-read ratio / per token (ms) "
        "| epsilon |",
        "|---|---|---|---|---|",
    ]
    for kernel, fit in plan.fits.items():
        if kernel == "slot":
            extra = f"{fit.reread_ratio:.2f}"
            cost = fit.first_read_cost
        else:
            extra = _ms(fit.token_cost)
            cost = fit.union_cost
        eps = fit.bandwidth_error
        lines.append(
            f"| {kernel} | {_ms(fit.fixed_time)} | {cost * 1e9:.3f} | {extra} | "
            f"{'-' if eps is None else f'{eps:.3f}'} |"
        )
    lines += [
        "",
        "## Verify time (ms) by pass size",
        "",
        "n: tokens verified in one pass; u(n): the expert bytes a deduplicating pass reads over "
        "those a per-slot pass reads; r(n): the deduplicating kernel's effective bandwidth over "
        "the per-slot kernel's (deduplication is faster where u(n) < r(n)); S(n): the time "
        "deduplication saves on the whole model's pass.",
        "",
        "| n | u(n) | r(n) | measured slot | measured dedup | predicted slot | "
        "predicted dedup | calibrated dedup | S(n) calibrated |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    predicted = plan.predictions["prediction"].verify_time
    measured = plan.measured_verify
    ratio = plan.bandwidth_ratio.get(dedup, {})
    for n in range(1, len(calibrated.saving) + 1):
        r = ratio.get(n)
        lines.append(
            f"| {n} | {plan.routing.byte_share[n - 1]:.3f} | "
            f"{'-' if r is None else f'{r:.3f}'} | {_ms(measured['slot'][n - 1])} | "
            f"{_ms(measured[dedup][n - 1])} | {_ms(predicted['slot'][n - 1])} | "
            f"{_ms(predicted[dedup][n - 1])} | "
            f"{_ms(calibrated.verify_time[dedup][n - 1])} | {_ms(calibrated.saving[n - 1])} |"
        )
    lines += [
        "",
        "## Best draft length (calibrated V(k))",
        "",
        "k*: the number of tokens to draft per step that gives the most tokens per second when "
        "each draft is accepted with the given probability, on the step times V(k) (the "
        "calibrated verify time of k + 1 tokens plus the draft's time for k); "
        "speedup: its tokens per second over plain decoding's.",
        "",
        "| acceptance | k* | speedup |",
        "|---|---|---|",
    ]
    for a, entry in calibrated.staircase.by_acceptance.items():
        lines.append(f"| {a} | {entry.best_draft_length} | {entry.speedup:.3f} |")
    lines += [
        "",
        "Figures: bandwidth.png (each kernel's effective bandwidth against n), ratio.png (u(n) "
        "against r(n)), saving.png (S(n) predicted and measured, with the band the bandwidth "
        "error allows), staircase.png (k* against the acceptance, with the acceptances where it "
        "steps up).",
        "",
    ]
    return "\n".join(lines)
