"""The `moespec staircase` command: its JSON contract, its plot and its errors."""

import json
from fractions import Fraction

import pytest

from moespec.cli import main
from moespec.costmodel import best_draft_length, speedup, step_points


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_json_contract(capsys):
    code, out, _ = run_cli(
        capsys,
        "staircase",
        "--step-times",
        "1,2,2",
        "--acceptance",
        "0.5",
        "0.9",
        "13/20",
        "--json",
    )
    assert code == 0
    table = json.loads(out)
    assert set(table) >= {"step_points", "first_draft_threshold", "best_draft_length", "speedup"}
    assert table["best_draft_length"] == {"0.5": 0, "0.9": 2, "13/20": 2}
    assert table["first_draft_threshold"] == 1.0
    assert table["step_points"] == pytest.approx([float(p) for p in step_points([1, 2, 2])])
    assert table["speedup"]["0.9"] == pytest.approx(float(speedup([1, 2, 2], Fraction(9, 10), 2)))


def test_default_acceptances_are_eleven_from_0_2_to_0_98(capsys):
    _, out, _ = run_cli(capsys, "staircase", "--step-times", "1,1.2,1.5", "--json")
    keys = list(json.loads(out)["best_draft_length"])
    assert len(keys) == 11 and keys[0] == "0.2" and keys[-1] == "0.98"


def test_builtin_example_runs_and_matches_the_library(capsys):
    from moespec.cli.staircase import example_step_times

    code, out, _ = run_cli(capsys, "staircase", "--json")
    assert code == 0
    table = json.loads(out)
    step_times = example_step_times()
    assert table["best_draft_length"]["0.9"] == best_draft_length(step_times, Fraction(9, 10))


def test_text_output_lists_every_acceptance(capsys):
    code, out, _ = run_cli(capsys, "staircase", "--step-times", "1,2,2")
    assert code == 0
    assert "a1=0.618034" in out and "0.98" in out


@pytest.mark.parametrize(
    "step_times, message",
    [
        ("1,x", "'x' is not a number"),
        ("1", "at least two values"),
        ("1,-2", "not positive"),
        ("1,0", "not positive"),
        ("", "at least two values"),
    ],
)
def test_bad_step_times_exit_2_with_one_line(capsys, step_times, message):
    code, out, err = run_cli(capsys, "staircase", "--step-times", step_times)
    assert code == 2
    assert out == ""
    assert message in err and err.count("\n") == 1


def test_acceptance_outside_unit_interval_is_refused(capsys):
    code, _, err = run_cli(capsys, "staircase", "--step-times", "1,2", "--acceptance", "1")
    assert code == 2 and "not in [0, 1)" in err


def test_plot_is_written_and_not_clobbered(capsys, tmp_path):
    path = tmp_path / "stairs.png"
    code, _, _ = run_cli(capsys, "staircase", "--step-times", "1,1.3,1.7", "--plot", str(path))
    assert code == 0 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    before = path.read_bytes()
    code, _, err = run_cli(capsys, "staircase", "--step-times", "1,2", "--plot", str(path))
    assert code == 2 and "--force" in err and path.read_bytes() == before
    code, _, _ = run_cli(capsys, "staircase", "--step-times", "1,2", "--plot", str(path), "--force")
    assert code == 0 and path.read_bytes() != before
    assert [p.name for p in tmp_path.iterdir()] == ["stairs.png"]  # no temporary left behind
