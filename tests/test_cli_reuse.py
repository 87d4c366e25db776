"""The `moespec reuse` and `moespec synth-trace` commands: contracts, plot and errors."""

import json

import numpy as np
import pytest

from moespec.cli import main
from moespec.routing.reuse import document_statistics, estimate, split_trace
from moespec.routing.store import read_trace, write_trace
from moespec.routing.synthetic import LocalityProcess, synthetic_trace


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def trace_file(tmp_path):
    trace = synthetic_trace(
        LocalityProcess(16, 2, keep_probability=0.6),
        num_layers=2,
        tokens=3000,
        documents=30,
        expert_bytes=[10, 30],
        model="tiny",
    )
    return write_trace(trace, tmp_path / "t.parquet")


def test_reuse_json_contract(capsys, trace_file):
    code, out, _ = run_cli(
        capsys, "reuse", trace_file, "--max-n", "5", "--bootstrap", "50", "--json"
    )
    assert code == 0
    report = json.loads(out)
    assert report["n_tokens"] == [1, 2, 3, 4, 5]
    assert (report["num_layers"], report["num_experts"], report["top_k"]) == (2, 16, 2)
    assert report["bootstrap"] == 50 and report["split"] == "all"
    expected = estimate(document_statistics(read_trace(trace_file), 5), bootstrap=0)
    measured = report["measured"]
    assert measured["reuse_mean"] == pytest.approx(expected.reuse_mean.tolist())
    assert measured["byte_share"] == pytest.approx(expected.byte_share.tolist())
    assert len(measured["reuse"]) == 2 and len(measured["intervals"]["reuse_mean"]["low"]) == 5
    assert report["uniform"]["reuse"][1] == pytest.approx(2 / 16)
    assert report["random_pairing"]["reuse_mean"][1] < measured["reuse_mean"][1]


def test_reuse_split_reads_only_that_part(capsys, trace_file):
    code, out, _ = run_cli(
        capsys, "reuse", trace_file, "--split", "test", "--bootstrap", "0", "--max-n", "3", "--json"
    )
    assert code == 0
    part = split_trace(read_trace(trace_file), "test")
    assert json.loads(out)["num_documents"] == part.num_documents < 30


def test_reuse_text_lists_every_n_against_uniform(capsys, trace_file):
    code, out, _ = run_cli(capsys, "reuse", trace_file, "--bootstrap", "20")
    assert code == 0
    lines = out.splitlines()
    assert "2 MoE layers, 16 experts, top-2; 30 documents (all), 3000 tokens" in lines[0]
    assert [line.split()[0] for line in lines[3:]] == [str(n) for n in range(1, 10)]
    assert lines[4].split()[5] == "0.125"  # uniform rho(2) = m/N


def test_reuse_plot_is_a_png_and_is_not_clobbered(capsys, trace_file, tmp_path):
    plot = tmp_path / "reuse.png"
    code, out, _ = run_cli(capsys, "reuse", trace_file, "--bootstrap", "20", "--plot", plot)
    assert code == 0 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, _, err = run_cli(capsys, "reuse", trace_file, "--plot", plot)
    assert code == 2 and "already exists" in err


def test_reuse_of_a_file_that_is_not_a_trace_is_one_line_of_error(capsys, tmp_path):
    path = tmp_path / "x.parquet"
    path.write_text("hello")
    code, out, err = run_cli(capsys, "reuse", path)
    assert code == 2 and out == ""
    assert err.startswith(f"moespec reuse: error: {path}: not a readable Parquet file")
    assert err.count("\n") == 1


def test_synth_trace_of_a_custom_shape_hits_its_target(capsys, tmp_path):
    out = tmp_path / "s.parquet"
    code, stdout, _ = run_cli(
        capsys, "synth-trace", "--layers", "3", "--experts", "16", "--top-k", "2",
        "--expert-bytes", "1000", "--reuse2", "0.5", "--tokens", "6000", "--documents", "6",
        "--seed", "3", "--out", out,
    )  # fmt: skip
    assert code == 0 and "wrote" in stdout
    trace = read_trace(out)
    assert (trace.num_layers, trace.num_experts, trace.top_k) == (3, 16, 2)
    assert trace.expert_bytes == [1000] * 3 and trace.num_documents == 6
    assert trace.metadata["target_reuse2"] == 0.5 and trace.metadata["seed"] == 3
    reuse2 = estimate(document_statistics(trace, 2), bootstrap=0).reuse_mean[1]
    assert reuse2 == pytest.approx(0.5, abs=0.03)  # 6000 tokens: looser than the fit's 0.02


def test_synth_trace_of_a_preset_shape_takes_its_layers_and_bytes(capsys, tmp_path):
    out = tmp_path / "s.parquet"
    code, _, _ = run_cli(
        capsys, "synth-trace", "--shape", "deepseek-v2-lite", "--uniform", "--tokens", "50",
        "--out", out,
    )  # fmt: skip
    assert code == 0
    trace = read_trace(out)
    assert trace.model == "deepseek-v2-lite" and trace.layer_indices == list(range(1, 27))
    assert trace.expert_bytes == [3 * 2048 * 1408 * 2] * 26
    assert trace.metadata["process"] == "locality" and trace.metadata["keep_probability"] == 0
    assert np.all(np.diff(np.sort(trace.expert_ids, -1), axis=-1) > 0)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--shape", "olmoe-1b-7b", "--layers", "2"], "--shape fixes the shape"),
        (["--layers", "2", "--experts", "8"], "give --shape NAME, or all of"),
        (["--layers", "2", "--experts", "8", "--top-k", "8", "--expert-bytes", "1"], "below"),
        (["--shape", "deepseek-v2-lite"], "give --reuse2 R"),
        (["--shape", "olmoe-1b-7b", "--reuse2", "0.05"], "below"),
    ],
)
def test_synth_trace_bad_input_is_one_line(capsys, tmp_path, argv, message):
    out = tmp_path / "s.parquet"
    code, _, err = run_cli(capsys, "synth-trace", *argv, "--tokens", "100", "--out", out)
    assert code == 2 and message in err and err.count("\n") == 1
    assert not out.exists()
