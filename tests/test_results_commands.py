"""Every file in benchmarks/results/ has the exact command that makes it, and vice versa."""

import shlex
from pathlib import Path

from moespec.bench.results import RESULTS, RESULTS_DIR
from tests.checkpoints import run_script

ROOT = Path(__file__).resolve().parent.parent


def committed_results() -> set[str]:
    directory = ROOT / RESULTS_DIR
    return {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()}


def test_every_result_file_has_a_command_and_every_command_output_exists():
    listed = [output for result in RESULTS for output in result.outputs]
    assert len(listed) == len(set(listed)), "an output is listed twice"
    committed = committed_results()
    assert committed - set(listed) == set(), "files without a command"
    assert set(listed) - committed == set(), "commands whose output is not committed"


def test_every_command_names_a_script_or_command_that_exists():
    names = [r.name for r in RESULTS]
    assert len(names) == len(set(names))
    for result in RESULTS:
        for command in result.commands:
            words = shlex.split(command)
            if words[0] == "python" and words[1] != "-c":
                assert (ROOT / words[1]).is_file(), command
            assert words[0] in {"python", "moespec", "test"}, command


def test_regenerate_lists_every_command():
    done = run_script(ROOT / "benchmarks" / "regenerate", ["--list"])
    assert done.returncode == 0, done.stderr
    for result in RESULTS:
        assert all(f"$ {command}" in done.stdout for command in result.commands)
