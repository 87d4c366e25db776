"""Progress on a terminal and quiet elsewhere; an interrupted report leaves nothing behind."""

import io
import os
import pty
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moespec.cli import main
from moespec.progress import Progress, show_progress, using
from moespec.routing import RoutingTrace
from moespec.routing.store import write_trace

ROOT = Path(__file__).resolve().parents[1]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    rng = np.random.default_rng(0)
    ids = np.stack([rng.permutation(8)[:2] for _ in range(2 * 160)]).reshape(160, 2, 2)
    trace = RoutingTrace(
        ids.astype(np.int16), [0, 80, 160], ["a", "b"], 8, [10**6] * 2, [0, 1], model="tiny"
    )
    return write_trace(trace, tmp_path_factory.mktemp("trace") / "tiny.parquet")


def test_progress_shows_only_on_a_terminal(monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    assert show_progress(stream=Terminal())
    assert not show_progress(stream=io.StringIO())  # piped or redirected
    assert not show_progress(quiet=True, stream=Terminal())  # --json
    monkeypatch.setenv("TERM", "dumb")
    assert not show_progress(stream=Terminal())


def test_a_disabled_progress_writes_nothing(capsys):
    with Progress(False) as progress:
        progress.start("work", total=3)
        progress.step("one")
        progress.advance(2)
    assert capsys.readouterr() == ("", "")


def test_using_a_bool_is_silent_off_a_terminal(capsys):
    with using(True) as progress:  # stderr is captured here: not a terminal
        assert not progress.enabled
    own = Progress(False)
    with using(own) as given:
        assert given is own


def run_with_stderr_on_a_terminal(argv: list[str]) -> tuple[int, str]:
    """(exit status, what the command wrote to its stderr, a pseudo-terminal)."""
    leader, follower = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "xterm", "COLUMNS": "120"}
    process = subprocess.Popen(
        [sys.executable, "-m", "moespec", *argv],
        stdout=subprocess.DEVNULL,
        stderr=follower,
        env=env,
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the command closed its end
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    return process.wait(), b"".join(chunks).decode(errors="replace")


def simulate_argv(trace_file) -> list[str]:
    return ["simulate", "--trace", str(trace_file), "--tokens", "40", "--policy", "spac,lru"]


def test_simulate_draws_a_bar_on_a_terminal(trace_file):
    code, terminal = run_with_stderr_on_a_terminal(simulate_argv(trace_file))
    assert code == 0
    assert "simulating" in terminal and "runs" in terminal


def test_simulate_draws_no_bar_with_json_on_a_terminal(trace_file):
    code, terminal = run_with_stderr_on_a_terminal([*simulate_argv(trace_file), "--json"])
    assert code == 0 and "simulating" not in terminal


def test_simulate_draws_no_bar_when_stderr_is_piped(trace_file):
    result = subprocess.run(
        [sys.executable, "-m", "moespec", *simulate_argv(trace_file)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0 and result.stderr == ""
    assert "spac" in result.stdout


def test_an_interrupted_report_leaves_no_directory(capsys, trace_file, tmp_path, monkeypatch):
    import moespec.offload.sim.experiments as experiments

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(experiments, "sweep", interrupted)
    report = tmp_path / "report"
    code = main([*simulate_argv(trace_file), "--report", str(report)])
    err = capsys.readouterr().err
    assert code == 130
    assert f"nothing written to {report}" in err
    assert not report.exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no staging folder either


def test_an_interrupted_report_keeps_the_previous_one(capsys, trace_file, tmp_path, monkeypatch):
    report = tmp_path / "report"
    assert main([*simulate_argv(trace_file), "--report", str(report)]) == 0
    before = {p.name: p.read_bytes() for p in report.iterdir()}
    import moespec.offload.sim.experiments as experiments

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(experiments, "ablation_table", interrupted)
    code = main([*simulate_argv(trace_file), "--report", str(report), "--force"])
    assert code == 130
    assert {p.name: p.read_bytes() for p in report.iterdir()} == before


def test_an_interrupted_plan_leaves_no_empty_directory(checkpoint_dir, tmp_path, monkeypatch):
    import moespec.routing.record as record
    from moespec.calibrate.plan import make_plan

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(record, "record_trace", interrupted)
    directory, _ = checkpoint_dir("qwen3_moe")
    out = tmp_path / "plan"
    with pytest.raises(KeyboardInterrupt):
        make_plan(out, model_dir=directory, dtype="fp32", progress=False)
    assert not out.exists()
