"""A greedy loop that repeats one n-gram stops with finish reason "repetition"; the prompt is
echoed (dimmed) before its continuation on a terminal only."""

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

from moespec.cli import main
from moespec.decoding.generate import StepRecord
from moespec.decoding.repetition import is_loop, repeated_tail, stop_repetition

ROOT = Path(__file__).resolve().parents[1]


def records(token_lists):
    for tokens in token_lists:
        yield StepRecord("decode", list(tokens), 1, "slot", 0.0)


def test_repeated_tail_finds_the_ngram_and_its_copies():
    assert repeated_tail([9, 1, 2, 1, 2, 1, 2]) == (2, 3)
    assert repeated_tail([5, 5, 5, 5]) == (1, 4)
    assert repeated_tail([1, 2, 3, 4]) == (0, 0)
    assert repeated_tail([]) == (0, 0)


def test_a_loop_needs_the_copies_and_the_span():
    loop = [7, 8, 9] * 8  # 8 copies over 24 tokens
    assert is_loop([1, 2] + loop, repeats=8)
    assert not is_loop([1, 2] + loop[3:], repeats=8)  # 7 copies
    assert not is_loop([4] * 10, repeats=8)  # 10 copies, but 10 tokens < 24


def test_stop_repetition_ends_the_stream_where_the_loop_completes():
    steps = [[1, 2, 3], *([[7, 8]] * 20)]
    out = list(stop_repetition(records(steps), repeats=8))
    emitted = [t for r in out for t in r.tokens]
    assert out[-1].finish_reason == "repetition"
    assert emitted == [1, 2, 3] + [7, 8] * 12  # 24 tokens of loop: the first record that ends it
    assert all(r.finish_reason is None for r in out[:-1])


def test_a_long_record_is_cut_at_the_token_that_completes_the_loop():
    # a speculative step emits several tokens: the stop falls where a plain run's would
    one_by_one = list(stop_repetition(records([[1], *([[7], [8]] * 20)]), repeats=8))
    in_steps = list(stop_repetition(records([[1], [7, 8] * 5, [7, 8] * 5, [7, 8] * 10]), 8))
    tokens = [t for r in one_by_one for t in r.tokens]
    assert [t for r in in_steps for t in r.tokens] == tokens == [1] + [7, 8] * 12
    assert in_steps[-1].finish_reason == "repetition" and in_steps[-1].tokens == [7, 8] * 2


def test_stop_repetition_zero_passes_everything_through():
    steps = [[1], *([[7, 8]] * 20)]
    out = list(stop_repetition(records(steps), repeats=0))
    assert len(out) == 21 and out[-1].finish_reason is None


def test_stop_repetition_closes_the_generator_it_wraps():
    closed = []

    def source():
        try:
            yield from records([[5]] * 100)
        finally:
            closed.append(True)

    list(stop_repetition(source(), repeats=4))
    assert closed == [True]


def generate_json(capsys, directory, *extra):
    capsys.readouterr()
    argv = ["generate", "--model", str(directory), "w1 w2 w3", "--max-tokens", "64"]
    assert main([*argv, "--dtype", "fp32", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_stops_a_loop_exactly_where_the_rule_says(capsys, checkpoint_dir):
    directory, _ = checkpoint_dir("qwen3_moe")
    full = generate_json(capsys, directory, "--stop-repeats", "0")
    assert full["finish_reason"] == "length" and len(full["tokens"]) == 64
    # where the rule first holds over the steps of the unstopped run
    expected, finish = [], "length"
    for step in full["steps"]:
        expected += step["tokens"]
        if is_loop(expected, 8):
            finish = "repetition"
            break
    stopped = generate_json(capsys, directory)
    assert stopped["tokens"] == expected and stopped["finish_reason"] == finish


def test_the_summary_says_why_it_stopped(capsys, checkpoint_dir):
    directory, _ = checkpoint_dir("qwen3_moe")
    finish = generate_json(capsys, directory)["finish_reason"]
    argv = ["generate", "--model", str(directory), "w1 w2 w3", "--max-tokens", "64"]
    assert main([*argv, "--dtype", "fp32"]) == 0
    note = "repeated one n-gram 8 times in a row (--stop-repeats 0 decodes on)"
    assert (note in capsys.readouterr().err) == (finish == "repetition")


def run_on_a_terminal(argv) -> str:
    leader, follower = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "moespec", *argv],
        stdout=follower,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TERM": "xterm"},
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert process.wait() == 0
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.parametrize("terminal", [True, False])
def test_the_prompt_is_echoed_dimmed_on_a_terminal_only(checkpoint_dir, terminal):
    directory, _ = checkpoint_dir("qwen3_moe")
    argv = ["generate", "--model", str(directory), "w1 w2 w3", "--max-tokens", "3"]
    if terminal:
        out = run_on_a_terminal(argv)
    else:
        out = subprocess.run(
            [sys.executable, "-m", "moespec", *argv],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        ).stdout
    echoed = "\x1b[2mw1 w2 w3\x1b[0m"
    assert (echoed in out) == terminal
    assert out.replace(echoed, "").count("w") == 3  # the continuation itself


def test_a_speculative_run_stops_on_the_same_token_as_plain(capsys, checkpoint_dir):
    directory, _ = checkpoint_dir("qwen3_moe")
    result = generate_json(
        capsys, directory, "--draft", "lookup", "--draft-length", "4", "--compare-plain"
    )
    assert result["same_tokens_as_plain"]
    assert max(len(s["tokens"]) for s in result["steps"]) > 1  # steps of several tokens
