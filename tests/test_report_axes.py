"""Axes that count whole things (draft lengths, tokens per pass) carry integer ticks only."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402


@pytest.fixture
def saved_figures(monkeypatch):
    """The figures written by savefig during the test, with their ticks read at save time."""
    ticks = []
    real = Figure.savefig

    def record(self, *args, **kwargs):
        real(self, *args, **kwargs)  # draws, so the locators have run
        ax = self.axes[0]
        ticks.append((list(ax.get_xticks()), list(ax.get_yticks())))

    monkeypatch.setattr(Figure, "savefig", record)
    return ticks


def integers(values) -> bool:
    return all(float(v).is_integer() for v in values)


def test_staircase_draft_length_axis_is_whole(saved_figures, tmp_path):
    from moespec.report.staircase import plot_staircase

    plot_staircase([1.0, 1.2, 1.5], str(tmp_path / "s.png"))  # k_max = 2: few ticks
    ((_, y_ticks),) = saved_figures
    assert integers(y_ticks)


def test_plan_figures_pass_size_axis_is_whole(saved_figures, tmp_path):
    from moespec.report.plan import _save

    fig, ax = plt.subplots()
    ax.plot([2, 3, 4], [0.8, 0.85, 0.9])
    _save(fig, tmp_path / "ratio.png")
    plt.close(fig)
    ((x_ticks, _),) = saved_figures
    assert integers(x_ticks)
