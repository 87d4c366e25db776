"""What every command shares: arguments checked before torch loads, in one line; dtype
names; repeated list flags; a closed pipe; the demo model as the default everywhere."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moespec.cli import main

ROOT = Path(__file__).resolve().parents[1]


def run_cli(capsys, *argv):
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def python(code: str, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, **kwargs
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "hello", "--max-tokens", "0"],
        ["generate", "hello", "--temperature", "-1"],
        ["generate", "hello", "--top-p", "0"],
        ["generate", "hello", "--dtype", "float16"],
        ["trace", "--corpus", "x", "--out", "t.parquet", "--chunk-tokens", "0"],
        ["plan", "--repeats", "0"],
        ["measure-verify", "--depth", "-3"],
        ["reuse", "t.parquet", "--confidence", "1.5"],
        ["synth-trace", "--shape", "olmoe-1b-7b", "--tokens", "0", "--out", "x.parquet"],
        ["generate", "hello", "--plan", "no-such-plan.json"],
        ["plan", "--trace", "no-such-trace.parquet"],
        ["plan", "--shape", "olmoe-1b-7b", "--device", "gpu"],
    ],
)
def test_a_bad_argument_fails_in_one_line_before_torch_is_imported(argv):
    result = python(
        "import sys\n"
        "from moespec.cli import main\n"
        f"code = main({argv!r})\n"
        "print(code, 'torch' in sys.modules)\n"
    )
    assert result.stdout.split() == ["2", "False"]
    assert result.stderr.count("\n") == 1 and "error: argument" in result.stderr
    assert f"(see moespec {argv[0]} --help)" in result.stderr


@pytest.mark.parametrize("name, canonical", [("float32", "fp32"), ("bfloat16", "bf16")])
def test_torch_dtype_names_are_accepted(capsys, checkpoint_dir, tmp_path, name, canonical):
    directory, _ = checkpoint_dir("olmoe")
    corpus = tmp_path / "doc.txt"
    corpus.write_text("w1 w2 w3 w4")
    out = tmp_path / "t.parquet"
    code, _, _ = run_cli(
        capsys, "trace", "--model", directory, "--corpus", corpus, "--out", out, "--dtype", name
    )
    from moespec.routing.store import read_trace

    assert code == 0 and read_trace(out).dtype == canonical


def test_generate_accepts_float32(capsys, checkpoint_dir):
    directory, _ = checkpoint_dir("qwen3_moe")
    code, out, _ = run_cli(
        capsys, "generate", "--model", directory, "w1 w2", "--max-tokens", 2,
        "--dtype", "float32", "--json",
    )  # fmt: skip
    assert code == 0 and len(json.loads(out)["tokens"]) == 2


def test_repeated_acceptance_flags_add_up(capsys):
    code, out, _ = run_cli(
        capsys, "staircase", "--acceptance", "0.5", "--acceptance", "0.9", "0.95", "--json"
    )
    assert code == 0
    assert list(json.loads(out)["best_draft_length"]) == ["0.5", "0.9", "0.95"]


def test_without_acceptance_flags_the_default_grid_is_used(capsys):
    code, out, _ = run_cli(capsys, "staircase", "--json")
    assert code == 0 and len(json.loads(out)["best_draft_length"]) == 11


def test_repeated_corpus_flags_add_up(capsys, checkpoint_dir, tmp_path):
    directory, _ = checkpoint_dir("olmoe")
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("w1 w2 w3")
    second.write_text("w4 w5")
    out = tmp_path / "t.parquet"
    code, stdout, _ = run_cli(
        capsys, "trace", "--model", directory, "--corpus", first, "--corpus", second, "--out", out
    )
    assert code == 0 and "2 documents, 5 tokens" in stdout


def test_a_closed_pipe_ends_quietly_with_status_0(tmp_path):
    from moespec.routing.store import write_trace
    from moespec.routing.synthetic import LocalityProcess, synthetic_trace

    trace = synthetic_trace(
        LocalityProcess(16, 2, keep_probability=0.5), num_layers=2, tokens=400, documents=8
    )
    path = write_trace(trace, tmp_path / "t.parquet")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-m", "moespec", "reuse", str(path), "--bootstrap", "50"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    process.stdout.close()  # the reader is gone before the command writes a byte
    stderr = process.stderr.read().decode()
    assert process.wait() == 0
    assert stderr == ""  # no traceback, no "Broken pipe", no "Exception ignored"


def test_piped_into_head_the_first_line_comes_and_nothing_else(tmp_path):
    from moespec.routing.store import write_trace
    from moespec.routing.synthetic import LocalityProcess, synthetic_trace

    trace = synthetic_trace(
        LocalityProcess(16, 2, keep_probability=0.5), num_layers=2, tokens=400, documents=8
    )
    path = write_trace(trace, tmp_path / "t.parquet")
    command = (
        f"set -o pipefail; {sys.executable} -m moespec reuse {path} --max-n 9 --bootstrap 20 "
        "| head -1"
    )
    result = subprocess.run(
        ["bash", "-c", command],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.startswith(str(path)) and result.stdout.count("\n") == 1


def test_trace_defaults_to_the_demo_model(capsys, tmp_path):
    corpus = tmp_path / "doc.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n")
    out = tmp_path / "t.parquet"
    code, stdout, _ = run_cli(capsys, "trace", "--corpus", corpus, "--out", out)
    from moespec.routing.store import read_trace

    assert code == 0 and "1 documents" in stdout
    assert read_trace(out).num_experts == 16  # the demo MoE's experts


def test_json_names_the_demo_draft_as_it_names_the_model(capsys):
    code, out, _ = run_cli(capsys, "generate", "def f(x):", "--max-tokens", 2, "--json")
    result = json.loads(out)
    assert code == 0
    assert result["model"] == "moespec/demo/target"
    assert result["draft"] == "auto:moespec/demo/draft"  # auto among its draft, lookup, none


@pytest.mark.parametrize("command", ["generate", "trace", "plan", "measure-verify"])
def test_a_missing_model_directory_fails_before_torch_is_imported(command, tmp_path):
    argv = {"generate": ["generate", "hi"], "trace": ["trace", "--corpus", "x", "--out", "t"]}
    missing = str(tmp_path / "nowhere")
    result = python(
        "import sys\n"
        "from moespec.cli import main\n"
        f"code = main({[*argv.get(command, [command]), '--model', missing]!r})\n"
        "print(code, 'torch' in sys.modules)\n"
    )
    assert result.stdout.split() == ["2", "False"]
    assert f"{missing} is not a checkpoint directory" in result.stderr
    assert result.stderr.count("\n") == 1
