"""The GPU expert-kernel benchmark's parts that need no GPU: ids, windows, bytes, the summary
(beta_p(n), r(n), u(n), crossover), JSON and figure, the alternatives' arithmetic, the command."""

import json
import statistics
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moespec.bench.gpu_passes as passes
import moespec.bench.gpu_timing as timing
from moespec.kernels import ExpertWeights, reference_experts
from moespec.routing.shapes import SHAPES, ModelShape
from moespec.routing.trace import RoutingTrace
from tests import checkpoints

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_expert_kernels.py"


def run_script(argv: list[str]):
    """The benchmark's command line, run as a maintainer runs it."""
    return checkpoints.run_script(SCRIPT, argv)


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 16), top_k=st.integers(1, 8), extra=st.integers(1, 120), seed=st.integers())
def test_chosen_ids_name_the_fewest_and_the_most_distinct_experts(n, top_k, extra, seed):
    num_experts = top_k + extra
    rng = np.random.default_rng(abs(seed))
    fewest = passes.chosen_ids("fewest", n, top_k, num_experts, rng)
    most = passes.chosen_ids("most", n, top_k, num_experts, rng)
    assert fewest.shape == most.shape == (n, top_k)
    assert passes.distinct_count(fewest) == top_k
    assert passes.distinct_count(most) == min(n * top_k, num_experts)
    for ids in (fewest, most):  # a token's top-k experts are distinct
        assert all(len(set(row)) == top_k for row in ids.tolist())
        assert ids.min() >= 0 and ids.max() < num_experts


def test_requested_bytes_are_slots_for_per_slot_and_distinct_experts_otherwise():
    assert passes.requested_bytes("slot", 3, 8, 10, 100) == 3 * 8 * 100
    for kernel in ("dedup", "linear-loop", "grouped_mm", "transformers"):
        assert passes.requested_bytes(kernel, 3, 8, 10, 100) == 10 * 100


def test_trace_windows_never_cross_a_document():
    ids = np.arange(10 * 2 * 2).reshape(10, 2, 2) % 16  # [T, L, m]
    ids[:, :, 1] = 16 + ids[:, :, 0] % 3  # keep each row's two experts distinct
    trace = RoutingTrace(ids, np.array([0, 3, 8, 10]), ["a", "b", "c"], 20, [1, 1], [0, 1])
    windows = passes.trace_windows(
        trace.expert_ids, trace.doc_starts, 3, 200, np.random.default_rng(0)
    )
    starts = {w["start"] for w in windows}
    assert starts <= {0, 3, 4, 5}  # doc "a" [0, 3), "b" [3, 8); "c" is too short
    assert {w["layer"] for w in windows} == {0, 1}
    for w in windows:
        assert np.array_equal(w["ids"], ids[w["start"] : w["start"] + 3, w["layer"]])


def test_a_npy_trace_is_checked_against_the_shape(tmp_path):
    shape = SHAPES["gpt-oss-20b"]  # 32 experts, top-4
    path = tmp_path / "ids.npy"
    np.save(path, np.tile(np.arange(4), (5, 1)))  # [T, m]
    ids, starts = passes.load_trace(path, shape)
    assert ids.shape == (5, 1, 4) and starts.tolist() == [0, 5]
    np.save(path, np.tile(np.arange(8), (5, 1)))
    with pytest.raises(ValueError, match="ids.npy: ids must be top-4 of 32 experts"):
        passes.load_trace(path, shape)


def test_a_parquet_trace_is_read_with_the_routing_store(tmp_path):
    store = pytest.importorskip("moespec.routing.store")
    shape = SHAPES["gpt-oss-20b"]
    ids = np.stack([np.arange(4) + t % 5 for t in range(6)])[:, None, :]  # [T, L, m]
    trace = RoutingTrace(ids, np.array([0, 2, 6]), ["a", "b"], 32, [shape.bytes_per_expert], [0])
    store.write_trace(trace, tmp_path / "t.parquet")
    loaded, starts = passes.load_trace(tmp_path / "t.parquet", shape)
    assert np.array_equal(loaded, ids) and starts.tolist() == [0, 2, 6]
    with pytest.raises(ValueError, match="32 experts, olmoe-1b-7b has 64"):
        passes.load_trace(tmp_path / "t.parquet", SHAPES["olmoe-1b-7b"])


def _record(kernel, n, top_k, distinct, time_us, ids="most", expert_bytes=1_000_000):
    return {
        "shape": "s",
        "ids": ids,
        "n": n,
        "window": None,
        "kernel": kernel,
        "distinct": distinct,
        "slots": n * top_k,
        "expert_bytes": expert_bytes,
        "bytes": passes.requested_bytes(kernel, n, top_k, distinct, expert_bytes),
        "times_us": [time_us * 0.9, time_us, time_us * 1.2],
    }


def _results():
    """Top-2 passes of n = 1..4 naming 2 experts: per-slot 10 n us, dedup 12 us."""
    timings = []
    for n in range(1, 5):
        timings += [_record("slot", n, 2, 2, 10.0 * n), _record("dedup", n, 2, 2, 12.0)]
    return {"copy_bandwidth": {"bytes_per_s": 1e12}, "timings": timings, "complete": True}


def test_summary_gives_bandwidths_ratio_byte_share_and_crossover():
    series = passes.summarize(_results())["s"]["most"]
    point = series["points"][2]
    assert point["slot"]["bandwidth"] == pytest.approx(4e6 / 20e-6)  # n m w / time
    assert point["dedup"]["bandwidth"] == pytest.approx(2e6 / 12e-6)  # U w / time
    assert point["bandwidth_ratio"] == pytest.approx((2e6 / 12e-6) / (4e6 / 20e-6))
    assert point["byte_share"] == pytest.approx(0.5)  # U / (n m)
    assert point["slot"]["copy_fraction"] == pytest.approx(4e6 / 20e-6 / 1e12)
    assert point["saving_us"] == pytest.approx(8.0)
    assert series["crossover"] == 2  # dedup faster from n = 2 on (12 < 20, 30, 40)
    assert series["targets_met"] == {"r(n) >= 0.9": False, "slot >= 0.7 of copy": False}


def test_windows_of_a_trace_sum_bytes_and_times():
    records = [_record("slot", 2, 2, u, t, ids="trace") for u, t in ((3, 10.0), (4, 30.0))]
    point = passes.summarize({"copy_bandwidth": {"bytes_per_s": 1e12}, "timings": records})
    point = point["s"]["trace"]["points"][2]
    assert point["slot"]["bandwidth"] == pytest.approx(8e6 / 40e-6)
    assert point["byte_share"] == pytest.approx(7 / 8)
    assert point["slot"]["windows"] == 2


@pytest.mark.parametrize(
    "savings, expected",
    [
        ({1: -1, 2: -1, 3: 2, 4: 1}, 3),
        ({2: 1, 3: -1, 4: 1}, 4),  # faster at 2, slower at 3: it stays faster only from 4
        ({2: -1, 3: -2}, None),
        ({1: 5, 2: 1}, 2),  # a pass of one token is never a crossover
    ],
)
def test_the_crossover_is_where_deduplication_stays_faster(savings, expected):
    assert passes.crossover(savings) == expected


def test_finish_writes_json_and_figure_and_plot_redraws_it(tmp_path):
    out, figure = tmp_path / "r.json", tmp_path / "r.png"
    assert passes.finish(_results(), out, figure) == 0
    saved = json.loads(out.read_text())
    assert saved["summary"]["s"]["most"]["crossover"] == 2
    assert figure.stat().st_size > 10_000
    figure.unlink()
    assert run_script(["--plot", str(out)]).returncode == 0
    assert figure.exists()
    again = run_script(["--plot", str(out)])
    assert again.returncode == 2 and "already exists" in again.stderr  # kept without --force


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_the_benchmark_refuses_with_status_2(tmp_path):
    done = run_script(["--out", str(tmp_path / "r.json")])
    assert done.returncode == 2 and "CUDA is not available" in done.stderr
    assert not list(tmp_path.iterdir())


def test_the_dry_run_prints_every_pass_and_the_run_count():
    args = ["--dry-run", "--no-compile", "--shapes", "olmoe-1b-7b", "--tokens", "1,9"]
    done = run_script(args)
    assert done.returncode == 0, done.stderr
    assert "n 9 fewest U   8" in done.stdout and "n 9 most   U  64" in done.stdout
    assert f"{2 * 2 * len(passes.KERNELS) * 20} timed runs" in done.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tokens", "0-3"], "pass sizes must lie in 1..16"),
        (["--shapes", "olmoe"], "unknown ['olmoe']"),
        (["--trace", "t.npy"], "--trace and --trace-shape go together"),
    ],
)
def test_bad_arguments_are_refused(argv, message):
    done = run_script(argv)
    assert done.returncode == 2 and message in done.stderr


def _cpu_pass(dtype):
    generator = torch.Generator().manual_seed(0)
    experts = ExpertWeights(
        torch.randn(8, 2 * 24, 16, generator=generator).to(dtype) / 4,
        torch.randn(8, 16, 24, generator=generator).to(dtype) / 4,
    )
    x = torch.randn(5, 16, generator=generator).to(dtype)
    ids = torch.tensor([[1, 6], [6, 1], [3, 1], [0, 7], [6, 2]])
    weights = torch.softmax(torch.randn(5, 2, generator=generator), -1)
    expected = reference_experts(x.float(), ids, weights, experts.to(torch.float32))
    return x, ids, weights, experts, expected


@pytest.mark.parametrize("name", ["linear-loop", "grouped_mm", "transformers"])
def test_the_alternative_kernels_compute_the_expert_operation(name):
    x, ids, weights, experts, expected = _cpu_pass(torch.bfloat16)
    try:
        run = timing.kernel_runner(name, experts, 2, {}, ids.numpy())
        got = run(x, ids, weights)
    except (ImportError, NotImplementedError, RuntimeError) as error:
        pytest.skip(f"{name} does not run on this CPU: {error}")
    scale = expected.abs().max().item()
    assert (got.float() - expected).abs().max().item() <= 2e-2 * max(scale, 1.0)


def test_a_shape_is_timed_on_every_pass_and_checked_against_the_reference(monkeypatch):
    # The CUDA graph and event timer replaced by plain calls: the plumbing, not the times.
    monkeypatch.setattr(timing, "replayable", lambda fn, eager: (fn, False))
    calls = []
    timer = lambda run, repeats: [calls.append(run()) or 1.0 for _ in range(repeats)]  # noqa: E731
    shape = ModelShape(
        "tiny", 1, (0,), num_experts=8, top_k=2, hidden_size=16, expert_intermediate_size=8
    )
    args = Namespace(
        seed=0,
        kernels=["linear-loop", "grouped_mm"],
        tokens=[1, 2],
        repeats=3,
        window_repeats=2,
        eager=True,
        windows=2,
    )
    trace = (np.array([[[0, 1]], [[1, 2]], [[2, 3]], [[3, 4]]]), np.array([0, 4]))
    plan = passes.plan_passes(args, shape, np.random.default_rng(0), trace)
    records, checks, unavailable = timing.time_shape(args, shape, timer, {}, plan, "cpu")
    if unavailable:
        pytest.skip(f"not on this CPU: {unavailable}")
    assert len(records) == len(plan) * 2 and len(calls) == (2 * 2 * 3 + 2 * 2 * 2) * 2
    assert {(c["kernel"], c["n"]) for c in checks} == {("linear-loop", 2), ("grouped_mm", 2)}
    assert all(c["ok"] for c in checks)
    window = next(r for r in records if r["ids"] == "trace")
    assert window["expert_ids"] == trace[0][window["window"]["start"] :][: window["n"], 0].tolist()
    assert window["distinct"] == window["n"] + 1 and window["bytes"] == window["distinct"] * (
        3 * 16 * 8 * 2
    )


def test_quartiles_of_one_sample_are_that_sample():
    assert passes.quartiles([3.0]) == (3.0, 3.0, 3.0)
    assert passes.quartiles([1.0, 2.0, 3.0, 4.0, 5.0])[1] == statistics.median([1, 2, 3, 4, 5])
