"""The `moespec trace` command: what it writes, what it keeps on Ctrl-C, and its errors."""

import json

import numpy as np
import pytest

from moespec.cli import main
from moespec.models import Tokenizer
from moespec.routing.store import read_trace

pytest.importorskip("transformers")


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("w1 w2 w3 w4 w5 w6 w7 w8 w9 w10")
    (folder / "b.txt").write_text("w11 w12 w13")
    jsonl = tmp_path / "more.jsonl"
    jsonl.write_text(json.dumps({"id": "j1", "text": "w20 w21 w22 w23"}) + "\n")
    return [folder, jsonl]


def test_trace_writes_every_token_of_every_document(capsys, checkpoint_dir, corpus, tmp_path):
    directory, _ = checkpoint_dir("olmoe")
    out = tmp_path / "t.parquet"
    code, stdout, _ = run_cli(
        capsys, "trace", "--model", directory, "--corpus", *corpus, "--out", out,
        "--dtype", "fp32", "--chunk-tokens", "4",
    )  # fmt: skip
    assert code == 0
    assert f"wrote {out}: 3 documents, 17 tokens" in stdout
    trace = read_trace(out)
    assert trace.doc_names == ["docs/a.txt", "docs/b.txt", "j1"]
    tokenizer = Tokenizer(directory / "tokenizer.json")
    lengths = [len(tokenizer.encode(t)) for t in ("w1 w2 w3 w4 w5 w6 w7 w8 w9 w10", "w11 w12 w13")]
    assert np.diff(trace.doc_starts).tolist() == [*lengths, 4]
    assert (trace.num_layers, trace.num_experts, trace.top_k, trace.dtype) == (3, 8, 2, "fp32")
    assert trace.gate_weights is not None and trace.metadata["chunk_tokens"] == 4


def test_max_tokens_limits_the_trace(capsys, checkpoint_dir, corpus, tmp_path):
    directory, _ = checkpoint_dir("olmoe")
    out = tmp_path / "t.parquet"
    code, _, _ = run_cli(
        capsys, "trace", "--model", directory, "--corpus", *corpus, "--out", out,
        "--max-tokens", "12",
    )  # fmt: skip
    assert code == 0
    assert read_trace(out).num_tokens == 12


def test_ctrl_c_keeps_the_documents_already_routed(
    capsys, checkpoint_dir, corpus, tmp_path, monkeypatch
):
    import moespec.routing.record as record

    real = record.record_routing

    def interrupted_after_one(*args, **kwargs):
        for i, document in enumerate(real(*args, **kwargs)):
            if i == 1:
                raise KeyboardInterrupt
            yield document

    monkeypatch.setattr(record, "record_routing", interrupted_after_one)
    directory, _ = checkpoint_dir("olmoe")
    out = tmp_path / "t.parquet"
    code, _, err = run_cli(capsys, "trace", "--model", directory, "--corpus", *corpus, "--out", out)
    assert code == 130
    assert "kept 1 complete documents" in err
    assert read_trace(out).doc_names == ["docs/a.txt"]


def test_an_existing_output_is_refused_before_any_work(capsys, corpus, tmp_path):
    out = tmp_path / "t.parquet"
    out.write_text("precious")
    not_a_model = tmp_path  # a directory, but loading it would fail: it is never loaded
    code, _, err = run_cli(
        capsys, "trace", "--model", not_a_model, "--corpus", *corpus, "--out", out
    )
    assert code == 2 and "already exists (pass --force" in err and err.count("\n") == 1
    assert out.read_text() == "precious"


def test_a_missing_corpus_is_one_line_of_error_before_the_model_loads(capsys, tmp_path):
    code, _, err = run_cli(
        capsys, "trace", "--model", tmp_path, "--corpus", tmp_path / "nowhere",
        "--out", tmp_path / "t.parquet",
    )  # fmt: skip
    assert code == 2 and "no such corpus file or folder" in err and err.count("\n") == 1
    assert not (tmp_path / "t.parquet").exists()
