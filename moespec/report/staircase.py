"""The staircase figure: k*(a) against a, with its step points."""

from collections.abc import Sequence

from moespec.files import atomic_path


def plot_staircase(step_times: Sequence, path: str, *, force: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from moespec.costmodel import best_draft_length, step_points

    grid = [i / 2000 for i in range(2000)]
    best = [best_draft_length([float(v) for v in step_times], a) for a in grid]
    points = [float(p) for p in step_points(step_times)]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    ax.step(grid, best, where="post", color="tab:blue", label="best draft length k*(a)")
    for j, a_j in enumerate(points, start=1):
        if a_j < 1:
            ax.axvline(a_j, color="grey", lw=0.6, ls=":")
            ax.plot([a_j], [j], "o", mfc="white", color="tab:red", ms=4)
    ax.plot([], [], "o", mfc="white", color="tab:red", ms=4, label="step points a_j")
    ax.set_xlabel("acceptance a")
    ax.set_ylabel("k*(a)")
    ax.set_xlim(0, 1)
    ax.set_ylim(-0.3, len(step_times) - 0.7)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # draft lengths are whole tokens
    ax.legend(loc="upper left")
    ax.set_title("Best draft length for each acceptance rate, and where it steps up")
    fig.tight_layout()
    with atomic_path(path, force=force) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
