"""The simulator's disk-tier profile (moespec.offload.sim.disk_tier): its fit on measurements
with a known answer, the comparison's pass/fail, and the larger-than-memory benchmark's saved
routing traces replayed by the simulator."""

import argparse
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from moespec.offload import make_policy
from moespec.offload.sim import disk_tier as dt
from moespec.offload.sim.simulator import simulate

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _measurements(bandwidth=1.2e9, latency=80e-6, dense=3e-3, slot=2e-4, call=1e-4):
    probe = [
        {"block_bytes": b, "depth": d, "bytes_per_second": b / (latency + b / bandwidth) / s}
        for b in (MIB, 4 * MIB)
        for d, s in ((1, 0.5), (4, 1.0))  # depth 1 twice as slow: the fit must read depth 4
    ]
    return dt.DiskMeasurements(
        probe=tuple(probe),
        expert_bytes=6 * MIB,
        num_layers=16,
        top_k=8,
        in_memory_token_seconds=16 * (dense + 8 * slot + call),
        slot_seconds=slot,
        call_seconds=call,
        checksum_seconds=1e-3,
    )


def test_the_fit_recovers_the_link_and_the_dense_time_it_was_built_from():
    fit = dt.DiskProfileFit(io_threads=4, reads_per_expert=4).fit(_measurements())
    assert fit.link_bandwidth_ == pytest.approx(1.2e9, rel=1e-9)
    assert fit.read_latency_ == pytest.approx(80e-6, rel=1e-6)
    assert fit.dense_seconds_ == pytest.approx(3e-3, rel=1e-9)
    p = fit.profile_
    assert p.link_latency == pytest.approx(4 * 80e-6)
    copy = 4 * 80e-6 + 6 * MIB / 1.2e9
    assert fit.link_cpu_share_ == pytest.approx(1e-3 / copy)
    # int8: a slot's q = 2 w over the FLOP rate is the measured slot time, on both tiers
    assert 2 * 6 * MIB / p.accelerator_flops == pytest.approx(2e-4)
    assert p.cpu_flops == p.accelerator_flops and p.cpu_bandwidth == fit.link_bandwidth_
    assert p.await_all_copies and not p.hidden_link and p.tier_overlap == 0


def test_measurements_whose_slots_exceed_the_in_memory_time_are_refused():
    m = _measurements()
    bad = dt.DiskMeasurements(**{**m.__dict__, "in_memory_token_seconds": 1e-3})
    with pytest.raises(ValueError, match="measurements disagree"):
        dt.DiskProfileFit().fit(bad)


def test_an_arm_passes_within_the_tolerance_and_the_calibration_only_if_every_arm_does():
    assert dt.within(1.2) and dt.within(0.8) and not dt.within(1.21) and not dt.within(0.79)
    rows = {
        "lru|replay": {"ratio": 0.98, "within": True},
        "spac|replay": {"ratio": 1.28, "within": False},
        "lru|model": {"comparable": False},
    }
    verdict = dt.verdict(rows)
    assert verdict["per_arm"] == {"lru|replay": True, "spac|replay": False}
    assert verdict["not_comparable"] == ["lru|model"]
    assert not verdict["passed"] and verdict["worst_ratio"] == 1.28
    assert dt.verdict({"lru|replay": {"ratio": 1.1, "within": True}})["passed"]
    assert not dt.verdict({"lru|model": {"comparable": False}})["passed"]  # nothing compared


def test_a_comparison_counts_the_cpu_tiers_reads_as_bytes_read():
    simulated = {"tokens_per_second": 4.0, "tokens": 10, "bytes_copied": 100, "cpu_experts": 5,
                 "hit_rate": 0.5, "copy_wait_seconds": 0.0, "steps": 10}  # fmt: skip
    row = dt.compare({"tokens_per_second": 5.0}, simulated, expert_bytes=20)
    assert row["ratio"] == pytest.approx(0.8) and row["within"]
    assert row["simulated_bytes_read_per_token"] == pytest.approx((100 + 5 * 20) / 10)


def test_the_recorder_keeps_emitted_positions_and_the_rejected_drafts_routing():
    bench = _script("larger_than_memory")
    recorder = bench.PassRecorder([0, 1])
    rows = [(2, 0), (3, 1), (3, 2)]  # prompt of 2, then passes (n_tokens, accepted)
    value = 0
    for n, _ in [(2, None), *[(n, a) for n, a in rows[1:]]]:
        for layer in (0, 1):
            ids = torch.arange(value, value + n)[:, None].expand(n, 2) % 8
            recorder(layer, ids, None)
        value += n
    ids, rejected = recorder.positions(2, rows[1:])
    # pass 1 (rows 2-4) keeps rows 2, 3; its row 4 was a rejected draft at position 4
    assert ids[:, 0, 0].tolist() == [0, 1, 2, 3, 5, 6, 7]
    assert rejected[4, 0, 0] == 4 and rejected[5, 0, 0] == ids[5, 0, 0]


def test_saved_traces_replay_in_the_simulator_with_the_measured_steps(tmp_path):
    bench, sim = _script("larger_than_memory"), _script("simulate_disk_tier")
    rng = np.random.default_rng(0)
    layers, experts, prompt, k = [0, 1, 2], 8, 6, 2
    accepted = [2, 0, 1, 2]
    tokens = prompt + sum(a + 1 for a in accepted)
    ids = np.stack([[rng.choice(experts, 2, replace=False) for _ in layers]
                    for _ in range(tokens)])  # fmt: skip
    facts = {"layer_indices": layers, "num_experts": experts, "expert_slot_bytes": 4096,
             "prompt": list(range(prompt))}  # fmt: skip
    run = {"tokens_per_second": 1.0, "accepted_per_step": accepted}
    routing = {"expert_ids": ids.tolist(), "rejected": ids.tolist()}
    out = tmp_path / "result.json"
    args = argparse.Namespace(draft_length=k, seed=0)
    runs = {"spac+draft|model": [run], "lru|model": [{**run, "accepted_per_step": [0] * 4}]}
    routings = {"spac+draft|model": [routing], "lru|model": [routing]}
    written = bench.save_traces(out, runs, routings, facts, args, {"model": None})
    assert {p.name for p in written} == {
        "spac+draft.model.parquet", "spac+draft.model.rejected.parquet", "lru.model.parquet"
    }  # fmt: skip
    found = sim.traces_for(argparse.Namespace(traces=None, measured=out), {"routing": {}}, bench)
    saved, rejected, meta = found["model"]["spac+draft"]
    assert np.array_equal(saved, ids) and meta["accepted_per_step"] == accepted
    arm = dt.MeasuredArm("spac+draft|model", "spac", k, tokens - prompt - 1, 4, tuple(accepted), {})
    trace = dt.trace_of(saved, experts, 4096, layers)
    settings = dt.comparable_settings(arm, slots=6, num_layers=3, num_experts=experts,
                                      fit_tokens=prompt, rejected=True)  # fmt: skip
    fit = dt.DiskProfileFit().fit(_measurements())
    policy = make_policy("spac").fit(trace.first_tokens(prompt))
    result = simulate(trace, policy, fit.profile_, settings, rejected)
    assert result.steps == len(accepted)
    assert result.tokens == tokens - prompt - 1  # the decode tokens: the prefill emitted one
