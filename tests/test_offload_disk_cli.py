"""`moespec generate --offload POLICY --memory-budget SIZE` on a tiny converted checkpoint: the
in-memory tokens from experts read off disk, the reads reported, bad budgets one line and exit 2."""

import json

import pytest

from moespec.cli import main

PROMPT = "w1 w2 w3 w1 w2"


@pytest.fixture(scope="module")
def converted(converted):
    """This module's converted directory: the session's fp32 one (conftest's `converted`)."""
    return converted("fp32")


def generate(capsys, directory, *flags):
    args = ["generate", "--model", str(directory), PROMPT, "--max-tokens", "10", "--dtype", "fp32"]
    code = main([*args, *flags])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_experts_from_disk_generate_the_in_memory_tokens(converted, capsys):
    draft = ["--draft", "oracle:0.7", "--draft-length", "3"]
    code, out, err = generate(capsys, converted, *draft, "--json")
    assert code == 0, err
    memory = json.loads(out)
    code, out, err = generate(
        capsys, converted, *draft, "--offload", "spac", "--memory-budget", "170K", "--json"
    )
    assert code == 0, err
    offloaded = json.loads(out)
    assert offloaded["tokens"] == memory["tokens"]
    report = offloaded["offload"]
    assert report["tier"] == "disk" and report["budget_bytes"] == 170 << 10
    assert report["slots"] < report["total_expert_bytes"] // report["expert_bytes"] / 2
    assert report["experts_read"] > 0 and report["disk_bytes_read"] > 0


def test_the_text_report_says_what_was_read_and_how(converted, capsys):
    code, _, err = generate(
        capsys, converted, "--draft", "none", "--offload", "lru", "--memory-budget", "100K"
    )
    assert code == 0, err
    assert "[offload lru on disk:" in err and " MiB in " in err and "stalled" in err
    assert "O_DIRECT" in err or "buffered" in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--memory-budget", "1K"],
            "--memory-budget 1.0K holds less than one layer's active experts: the least is",
        ),
        (["--memory-budget", "lots"], "a size such as 6G"),
        (["--memory-budget", "1G", "--offload-device", "cuda"], "--offload-device cuda"),
    ],
)
def test_bad_memory_budgets_are_one_line_and_exit_2(converted, capsys, flags, message):
    code, _, err = generate(capsys, converted, "--draft", "none", "--offload", "lru", *flags)
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_a_budget_beyond_available_memory_is_capped_with_one_warning_naming_the_flag(
    converted, capsys
):
    code, _, err = generate(
        capsys, converted, "--draft", "none", "--offload", "lru", "--memory-budget", "100000G"
    )
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, err
    assert warnings[0].startswith("warning: --memory-budget 100000.0G is more than this machine")
    assert "\x1f" not in err  # the setting rendered as a flag, no marker left raw


def test_a_memory_budget_needs_an_offload_policy(converted, capsys):
    code, _, err = generate(capsys, converted, "--draft", "none", "--memory-budget", "1G")
    assert code == 2 and "need --offload POLICY" in err
