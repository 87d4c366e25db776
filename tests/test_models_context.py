"""The model's context: text beyond max_position_embeddings is refused in one line, or cut
when asked, in the library and in every command that feeds text to a model."""

import json
import shutil

import pytest

from moespec.cli import main
from moespec.errors import cli_message
from moespec.models.context import ContextOverflowError, fit_context
from tests.checkpoints import edit_config

CONTEXT = 16


def run_cli(capsys, *argv):
    capsys.readouterr()  # drop what fixtures printed (transformers' save progress)
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def short_context(checkpoint_dir, tmp_path):
    """The tiny Qwen3-MoE checkpoint with a context of 16 positions."""
    source, _ = checkpoint_dir("qwen3_moe")
    directory = tmp_path / "short"
    shutil.copytree(source, directory)
    edit_config(directory, max_position_embeddings=CONTEXT)
    return directory


def words(count: int, start: int = 1) -> str:
    return " ".join(f"w{i}" for i in range(start, start + count))


def test_tokens_that_fit_are_returned_unchanged():
    assert fit_context([1, 2, 3], 8, new_tokens=5) == [1, 2, 3]


def test_overflow_names_the_numbers_and_the_fix():
    with pytest.raises(ContextOverflowError) as info:
        fit_context(list(range(20)), 16, new_tokens=4)
    message = str(info.value)
    assert "20 tokens + 4 to generate" in message and "context of 16 positions" in message
    assert "truncate='left'" in message and "12 tokens" in message and "\n" not in message
    assert "--truncate left" in cli_message(info.value) and "--" not in message


def test_truncate_left_keeps_the_last_tokens_and_right_the_first():
    tokens = list(range(20))
    assert fit_context(tokens, 16, new_tokens=4, truncate="left") == list(range(8, 20))
    assert fit_context(tokens, 16, truncate="right") == list(range(16))


def test_generating_the_whole_context_leaves_no_room_even_when_truncating():
    with pytest.raises(ContextOverflowError, match="leave no room"):
        fit_context([1], 16, new_tokens=16, truncate="left")


def test_a_server_can_give_its_own_advice():
    with pytest.raises(ContextOverflowError, match="send at most 4 tokens$"):
        fit_context([1] * 9, 4, fix="send at most {keep} tokens")


def test_generate_refuses_an_overlong_prompt_in_one_line(capsys, short_context):
    code, out, err = run_cli(
        capsys, "generate", "--model", short_context, words(14), "--max-tokens", 4
    )
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "14 tokens + 4 to generate" in err
    assert "context of 16 positions" in err


def test_generate_truncates_on_the_left_when_asked(capsys, short_context):
    code, out, err = run_cli(
        capsys, "generate", "--model", short_context, words(14), "--max-tokens", 4,
        "--truncate", "left", "--dtype", "fp32", "--json",
    )  # fmt: skip
    assert code == 0
    result = json.loads(out)
    assert result["prompt_tokens"] == list(range(3, 15))  # w3..w14: the last 12
    assert len(result["tokens"]) == 4


def test_generate_notes_the_truncation_on_stderr(capsys, short_context):
    code, _, err = run_cli(
        capsys, "generate", "--model", short_context, words(14), "--max-tokens", 4,
        "--truncate", "left",
    )  # fmt: skip
    assert code == 0 and "kept the last 12 of the prompt's 14 tokens" in err


def test_trace_refuses_a_document_beyond_the_context(capsys, short_context, tmp_path):
    corpus = tmp_path / "docs"
    corpus.mkdir()
    (corpus / "short.txt").write_text(words(5))
    (corpus / "long.txt").write_text(words(20))
    out = tmp_path / "t.parquet"
    code, _, err = run_cli(
        capsys, "trace", "--model", short_context, "--corpus", corpus, "--out", out
    )
    assert code == 2 and err.count("\n") == 1
    assert "document 'docs/long.txt' has 20 tokens" in err and "--truncate right" in err
    assert not out.exists()


def test_trace_truncate_right_keeps_each_documents_beginning(capsys, short_context, tmp_path):
    from moespec.routing.store import read_trace

    corpus = tmp_path / "long.txt"
    corpus.write_text(words(20))
    out = tmp_path / "t.parquet"
    code, _, _ = run_cli(
        capsys, "trace", "--model", short_context, "--corpus", corpus, "--out", out,
        "--truncate", "right", "--dtype", "fp32",
    )  # fmt: skip
    assert code == 0
    assert read_trace(out).num_tokens == CONTEXT
    assert read_trace(out).metadata["truncate"] == "right"


def test_measure_verify_refuses_a_depth_beyond_the_context(capsys, short_context, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(words(40))
    code, _, err = run_cli(
        capsys, "measure-verify", "--model", short_context, "--text", text, "--depth", 12,
        "--max-n", 9, "--verify-mode", "isolated",
    )  # fmt: skip
    assert code == 2 and err.count("\n") == 1
    assert "a pass after 12 tokens has 21 tokens" in err and "lower --depth" in err
    # in runs of consecutive passes (the default) the 9-token measurement ends 32 tokens on
    code, _, err = run_cli(
        capsys, "measure-verify", "--model", short_context, "--text", text, "--depth", 12,
        "--max-n", 9,
    )  # fmt: skip
    assert code == 2 and err.count("\n") == 1
    assert "a pass after 12 tokens has 44 tokens" in err


def test_routing_recorder_refuses_an_overlong_document(short_context):
    from moespec.models import load_model
    from moespec.routing.record import record_routing

    model, _ = load_model(short_context, dtype="fp32")
    with pytest.raises(ContextOverflowError, match="document 'd' has 17 tokens"):
        list(record_routing(model, [("d", list(range(17)))]))
