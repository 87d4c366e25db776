"""With fewer than a handful of documents, the bootstrap resamples blocks of tokens inside
them (or draws no interval and says why) instead of intervals that equal the estimate."""

import json

import numpy as np
import pytest

from moespec.cli import main
from moespec.routing import RoutingTrace
from moespec.routing.reuse import MIN_UNITS, block_length, document_statistics, reuse_report
from moespec.routing.store import write_trace
from moespec.routing.synthetic import LocalityProcess, synthetic_trace


def many_documents(documents=20, tokens=6000):
    process = LocalityProcess(16, 2, keep_probability=0.5, popularity_skew=0.3)
    return synthetic_trace(process, num_layers=2, tokens=tokens, documents=documents, seed=3)


def as_one_document(trace: RoutingTrace) -> RoutingTrace:
    return RoutingTrace(
        trace.expert_ids,
        [0, trace.num_tokens],
        ["all"],
        trace.num_experts,
        list(trace.expert_bytes),
        list(trace.layer_indices),
        model=trace.model,
    )


@pytest.mark.parametrize("block_tokens", [1, 7, 36, 1000])
def test_blocks_partition_every_documents_windows(block_tokens):
    trace = many_documents(documents=3, tokens=900)
    whole = document_statistics(trace, 6)
    blocks = document_statistics(trace, 6, block_tokens=block_tokens)
    assert len(blocks.windows) >= len(whole.windows)
    for field in ("windows", "reused", "distinct"):
        assert np.array_equal(getattr(blocks, field).sum(axis=0), getattr(whole, field).sum(axis=0))


def test_one_document_gets_a_block_interval_around_the_estimate():
    trace = as_one_document(many_documents())
    report = reuse_report(trace, max_n=4, bootstrap=400)
    assert report.resampling == f"blocks of {block_length(trace.num_tokens, 4)} tokens"
    low, high = report.measured.intervals["reuse_mean"]
    estimate = report.measured.reuse_mean
    assert np.all(low[1:] < estimate[1:]) and np.all(estimate[1:] < high[1:])


def test_the_block_interval_is_as_wide_as_the_document_interval_it_replaces():
    # The same tokens as 20 documents and as one: resampling documents and resampling
    # blocks of the one document estimate the same spread.
    trace = many_documents()
    by_documents = reuse_report(trace, max_n=3, bootstrap=1000, seed=1)
    by_blocks = reuse_report(as_one_document(trace), max_n=3, bootstrap=1000, seed=1)
    assert by_documents.resampling == "documents"
    assert by_blocks.resampling.startswith("blocks of ")
    width = {}
    for name, report in (("documents", by_documents), ("blocks", by_blocks)):
        low, high = report.measured.intervals["reuse_mean"][:, 1]
        width[name] = high - low
    assert 0.5 < width["blocks"] / width["documents"] < 2.0  # measured: 1.12-1.21


def test_too_few_tokens_for_blocks_draw_no_interval_and_say_why():
    trace = as_one_document(many_documents(documents=1, tokens=30))
    report = reuse_report(trace, max_n=9, bootstrap=200)
    assert report.bootstrap == 0 and report.measured.intervals == {}
    assert report.resampling is None
    assert "1 document(s) of 30 tokens make 1 block(s)" in report.no_interval
    assert f"needs {MIN_UNITS} or more" in report.no_interval


def test_reuse_command_names_what_it_resampled(capsys, tmp_path):
    path = write_trace(as_one_document(many_documents(tokens=2000)), tmp_path / "one.parquet")
    assert main(["reuse", str(path), "--bootstrap", "100", "--block-tokens", "50"]) == 0
    out = capsys.readouterr().out
    assert "100 bootstrap resamples of blocks of 50 tokens" in out


def test_reuse_command_says_why_there_is_no_interval(capsys, tmp_path):
    path = write_trace(as_one_document(many_documents(1, 30)), tmp_path / "short.parquet")
    assert main(["reuse", str(path), "--bootstrap", "100", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bootstrap"] == 0 and report["measured"]["intervals"] == {}
    assert "a bootstrap needs" in report["no_interval"]
    assert main(["reuse", str(path), "--bootstrap", "100"]) == 0
    assert "no intervals: 1 document(s) of 30 tokens" in capsys.readouterr().out
