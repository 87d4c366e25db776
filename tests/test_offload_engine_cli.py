"""`moespec generate --offload POLICY` on a tiny checkpoint: every policy, the budget flags."""

import json

import pytest

from moespec.cli import main
from moespec.offload import POLICY_NAMES

PROMPT = "w1 w2 w3 w1 w2"


def generate_json(capsys, directory, *flags):
    code = main(
        ["generate", "--model", str(directory), PROMPT, "--max-tokens", "10", "--dtype", "fp32"]
        + [*flags, "--json"]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out), captured.err


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_generates_the_in_memory_tokens(checkpoint_dir, capsys, policy):
    directory, _ = checkpoint_dir("qwen3_moe")
    draft = ["--draft", "none"] if policy == "spac-ar" else ["--draft", "oracle:0.7"]
    draft += ["--draft-length", "3"]
    memory, _ = generate_json(capsys, directory, *draft)
    offloaded, _ = generate_json(
        capsys, directory, *draft, "--offload", policy, "--expert-cache-ratio", "0.25"
    )
    assert offloaded["tokens"] == memory["tokens"]
    report = offloaded["offload"]
    assert report["policy"] == policy and report["device"] == "cpu"
    assert report["peak_cache_bytes"] <= report["budget_bytes"] <= report["total_expert_bytes"] / 4
    steps = offloaded["steps"]
    assert sum(s["hits"] + s["misses"] for s in steps) == offloaded["hits"] + offloaded["misses"]
    assert offloaded["bytes_copied"] == report["bytes_copied"]
    assert "hits" in memory and memory["hits"] == memory["misses"] == 0


def test_budget_in_bytes_and_text_report(checkpoint_dir, capsys):
    directory, _ = checkpoint_dir("qwen3_moe")
    args = ["generate", "--model", str(directory), PROMPT, "--max-tokens", "4", "--draft", "none"]
    assert main([*args, "--offload", "lru", "--expert-cache-bytes", "100000"]) == 0
    err = capsys.readouterr().err
    assert "[offload lru on cpu:" in err and "hit rate" in err


def test_budget_below_one_expert_is_one_line_and_exit_2(checkpoint_dir, capsys):
    directory, _ = checkpoint_dir("qwen3_moe")
    args = ["generate", "--model", str(directory), PROMPT, "--draft", "none", "--offload", "spac"]
    assert main([*args, "--expert-cache-bytes", "100"]) == 2
    err = capsys.readouterr().err
    assert "holds no expert: one expert is" in err and err.count("\n") == 1


def test_budget_holding_every_expert_runs_in_memory(checkpoint_dir, capsys):
    directory, _ = checkpoint_dir("qwen3_moe")
    result, err = generate_json(
        capsys, directory, "--draft", "none", "--offload", "lru", "--expert-cache-ratio", "1"
    )
    assert "running in memory" in err
    assert "offload" not in result and result["hits"] == 0


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--offload", "spac-ar", "--draft", "oracle:0.5"], "without a draft"),
        (["--expert-cache-ratio", "0.5", "--draft", "none"], "need --offload"),
        (["--offload", "fifo", "--draft", "none"], "unknown policy 'fifo'"),
        (["--offload", "lru", "--expert-cache-ratio", "0", "--draft", "none"], "must be > 0"),
    ],
)
def test_bad_offload_flags_exit_2(checkpoint_dir, capsys, flags, message):
    directory, _ = checkpoint_dir("qwen3_moe")
    assert main(["generate", "--model", str(directory), PROMPT, *flags]) == 2
    assert message in capsys.readouterr().err
