"""Calibration on the device the experts live on: the expert-operation benchmark, its timer
and `moespec plan --shape --device`; CUDA cases run where a CUDA device is."""

from types import SimpleNamespace

import pytest
import torch

from moespec.calibrate.bench import BenchSettings, ExpertOpBenchmark, random_experts
from moespec.calibrate.timing import CacheFlusher, time_runs
from moespec.cli import main

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no CUDA"))]
TINY = SimpleNamespace(num_experts=8, hidden_size=64, expert_intermediate_size=32)


def run_cli(capsys, *argv):
    capsys.readouterr()
    code = main([str(a) for a in argv])
    return code, *capsys.readouterr()


@pytest.mark.parametrize("device", DEVICES)
def test_the_benchmark_times_every_case_on_the_experts_device(device, tmp_path):
    experts = random_experts(TINY, torch.float32, device=device, pack=False)
    settings = BenchSettings(pass_sizes=(1, 2), chosen_levels=2, repeats=3, flush_bytes=2**20)
    bench = ExpertOpBenchmark({0: experts}, top_k=2, settings=settings)
    records = bench.run(tmp_path / "bench.jsonl", progress=False)
    assert {r["key"] for r in records} == {c.key for c in bench.cases()}
    assert all(len(r["seconds"]) == 3 and min(r["seconds"]) > 0 for r in records)
    assert bench.header.get("device") == (None if device == "cpu" else "cuda:0")


@pytest.mark.parametrize("device", DEVICES)
def test_time_runs_flushes_before_every_timed_run(device):
    flusher, calls = CacheFlusher(2**20, device), []

    def flush():
        calls.append("flush")
        flusher()

    samples = time_runs(
        lambda: calls.append("run"), repeats=4, warmup=2, flush=flush, device=device
    )
    assert len(samples) == 4 and all(s >= 0 for s in samples)
    assert calls == ["run", "run"] + ["flush", "run"] * 4
    assert flusher.buffer.device.type == device and flusher.buffer[0].item() == 4


@pytest.mark.skipif(CUDA, reason="this machine has CUDA")
def test_a_gpu_plan_without_cuda_is_refused_in_one_line(capsys, tmp_path):
    out = tmp_path / "plan"
    code, _, err = run_cli(
        capsys, "plan", "--shape", "olmoe-1b-7b", "--device", "cuda", "--out", out
    )
    assert code == 2 and err.count("\n") == 1
    assert "--device cuda: CUDA is not available on this machine" in err
    assert not out.exists()


def test_a_whole_model_plan_on_a_gpu_is_refused_in_one_line(capsys, tmp_path):
    code, _, err = run_cli(capsys, "plan", "--device", "cuda:0", "--out", tmp_path / "plan")
    assert code == 2 and err.count("\n") == 1
    assert "--device cuda:0 plans a --shape" in err and not (tmp_path / "plan").exists()
