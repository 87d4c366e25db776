"""The reuse figure (the analogue of seed 000 Fig. 1): layer-mean rho(n) against n, with its
bootstrap band, random pairing (dashed) and independent uniform routing (dotted)."""

import numpy as np

from moespec.files import atomic_path


def plot_reuse(report, path: str, *, force: bool = False, label: str | None = None) -> None:
    """Draw a `moespec.routing.reuse.ReuseReport` to a PNG file, atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = np.arange(1, report.max_n + 1)
    measured = report.measured
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    ax.plot(n, measured.reuse_mean, "o-", color="tab:blue", label=label or "trace")
    if "reuse_mean" in measured.intervals:
        low, high = measured.intervals["reuse_mean"]
        ax.fill_between(n, low, high, color="tab:blue", alpha=0.2, lw=0)
    ax.plot(
        n,
        report.random_pairing.reuse_mean,
        "--",
        color="tab:grey",
        label="random pairing (popularity only)",
    )
    ax.plot(
        n,
        report.uniform["reuse"],
        ":",
        color="black",
        label=f"uniform, m/N = {report.top_k}/{report.num_experts}",
    )
    ax.set_xlabel("consecutive tokens n")
    ax.set_ylabel("reuse ρ(n), layer mean")
    ax.set_xticks(n)
    ax.set_ylim(0, 1)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(f"Consecutive-token reuse: {report.model or 'trace'}")
    fig.tight_layout()
    with atomic_path(path, force=force) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
