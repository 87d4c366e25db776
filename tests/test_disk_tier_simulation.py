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
from moespec.offload.sim.hardware import HardwareProfile
from moespec.offload.sim.simulator import SimulationSettings, _Run, simulate

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


def test_dense_passes_timed_apart_give_the_dense_time_and_each_further_row():
    """A pass of 5 rows costing 1.8x one row: each further row 0.2 of the first, not a whole
    one (the residual reading priced every row as the first)."""
    m = _measurements()
    timed = dt.DiskMeasurements(
        **{**m.__dict__, "dense_pass_seconds": ((1, 16 * 2e-3), (5, 16 * 3.6e-3))}
    )
    fit = dt.DiskProfileFit().fit(timed)
    assert fit.dense_seconds_ == pytest.approx(2e-3)
    assert fit.dense_row_seconds_ == pytest.approx(0.4e-3)
    assert fit.profile_.layer_time == pytest.approx(2e-3)
    assert fit.profile_.layer_token_time == pytest.approx(0.4e-3)
    # the in-memory arm (built from a dense time of 3 ms) is then a check, not an input
    assert fit.in_memory_predicted_ == pytest.approx(16 * (2e-3 + 8 * 2e-4 + 1e-4))
    residual = dt.DiskProfileFit().fit(m)
    assert residual.dense_row_seconds_ == residual.dense_seconds_ == pytest.approx(3e-3)


def test_the_dense_passes_are_timed_with_no_expert_computed(converted, monkeypatch):
    from moespec.models import load_model

    model, _ = load_model(converted("int8"), pack_experts=False)
    model.native, model.batch_invariant = False, True
    for block in model.moe_blocks.values():  # a routed expert computed would raise
        monkeypatch.setattr(block, "experts", None)
    times = dt.measure_dense_passes(model, list(range(3, 19)), rows=(1, 5), repeats=3)
    assert sorted(times) == [1, 5] and all(t > 0 for t in times.values())


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


# The engine's order since it computes on arrival (compute_while_reading), against the order
# before it (await_all_copies), on cases worked by hand.
W = 1000  # bytes per expert: a copy takes 1 s, a slot 0.25 s, a kernel call 0.1 s


def _profile(**order):
    return HardwareProfile(
        name="hand", link_bandwidth=W / 1.0, link_latency=0.0, accelerator_bandwidth=1e15,
        accelerator_flops=2 * W / 0.25, accelerator_expert_time=0.0, accelerator_memory=0.0,
        cpu_bandwidth=W / 1.0, cpu_flops=2 * W / 0.25, cpu_expert_time=0.0, cpu_threads=1,
        layer_time=0.5, kernel_call_time=0.1, tier_overlap=0.0, hidden_link=False,
        link_cpu_share=0.0, **order,
    )  # fmt: skip


@pytest.mark.parametrize(
    "order, seconds, waited",
    [
        # step 1 (router out at 0.5): expert 2 resident, 0 read until 1.5. Before: the call
        # after the copy, 1.5 + 0.1 + 2 x 0.25 = 2.1, idle 1.0. Since: 2 while 0 is read
        # (0.5 + 0.35 = 0.85), idle to 1.5, then 0: 1.85. Step 2 (out at end + 0.5) the
        # same with 0 resident and 1 read: before 2.6 -> 4.2, since 2.35 -> 3.7
        ({"await_all_copies": True}, 4.2, 2.0),
        ({"compute_while_reading": True}, 3.7, 2 * 0.65),
    ],
)
def test_the_cached_experts_are_computed_while_the_misses_are_read(order, seconds, waited):
    trace = dt.trace_of([[[2, 3]], [[0, 2]], [[0, 1]]], 4, W, [0])  # fit on token 0: 2, 3 in
    settings = SimulationSettings(cache_ratio=1.0, draft_length=0, tokens=2, fit_tokens=1,
                                  bytes_per_parameter=1.0, record=True)  # fmt: skip
    policy = make_policy("lru").fit(trace.first_tokens(1))
    result = simulate(trace, policy, _profile(**order), settings)
    assert [list(layer["fetch"]) for layer in result.log["layers"]] == [[0], [1]]
    assert result.seconds == pytest.approx(seconds, abs=1e-6)
    assert result.stats.copy_wait_seconds == pytest.approx(waited, abs=1e-6)


def test_on_arrival_the_cpu_tier_runs_after_the_cached_experts_and_misses_come_in_groups():
    trace = dt.trace_of([[[0, 1]], [[2, 3]]], 4, W, [0])
    settings = SimulationSettings(cache_ratio=1.0, draft_length=0, tokens=1, fit_tokens=1,
                                  bytes_per_parameter=1.0)  # fmt: skip
    run = _Run(trace, make_policy("lru"), _profile(compute_while_reading=True), settings)
    experts, row = np.arange(4), np.array([1, 2, 1, 1])  # slots: 0.25, 0.5, 0.25, 0.25 s
    run.cache.ready_at[0, experts] = [0.0, 1.2, 2.0, 3.0]  # router out at 1.0: 0 is in
    busy, end, waited = run._on_arrival_time(0, experts, row, 1.0, cpu_busy=0.5)
    # 0 while the others are read: 1.0 + 0.1 + 0.25 = 1.35; the CPU tier: 1.85; 1 is in:
    # 1.85 + 0.1 + 0.5 = 2.45; 2 is in (3 is not): 2.8; idle to 3.0; 3: 3.35
    assert (busy, end, waited) == pytest.approx((1.25, 3.35, 0.2), abs=1e-9)
    run.cache.ready_at[0, experts] = 0.0  # nothing awaited: the CPU tier, then one call
    assert run._on_arrival_time(0, experts, row, 1.0, cpu_busy=0.5) == pytest.approx(
        (1.25, 1.0 + 0.5 + 0.1 + 1.25, 0.0), abs=1e-9
    )
    run.cache.ready_at[0, experts] = [1.5, 1.5, 4.0, 4.0]  # nothing in: no call before the CPU
    busy, end, waited = run._on_arrival_time(0, experts, row, 1.0, cpu_busy=0.5)
    # the CPU tier to 1.5, when 0 and 1 are in: 1.5 + 0.1 + 0.75 = 2.35; idle to 4.0; 2, 3
    assert (end, waited) == pytest.approx((4.0 + 0.1 + 0.5, 4.0 - 2.35), abs=1e-9)


def test_on_arrival_the_kernel_runs_on_every_thread_once_it_awaits_no_read():
    """The engine computes on one thread while reads are in flight, on every thread once the
    layer awaits none: here twice as fast a slot (0.125 s)."""
    trace = dt.trace_of([[[0, 1]], [[2, 3]]], 4, W, [0])
    settings = SimulationSettings(cache_ratio=1.0, draft_length=0, tokens=1, fit_tokens=1,
                                  bytes_per_parameter=1.0)  # fmt: skip
    profile = _profile(compute_while_reading=True, accelerator_flops_alone=2 * W / 0.125)
    run = _Run(trace, make_policy("lru"), profile, settings)
    experts, row = np.arange(4), np.array([1, 2, 1, 1])
    run.cache.ready_at[0, experts] = 0.0  # nothing awaited: one call on every thread
    assert run._on_arrival_time(0, experts, row, 1.0, cpu_busy=0.5) == pytest.approx(
        (0.625, 1.0 + 0.5 + 0.1 + 0.625, 0.0), abs=1e-9
    )
    run.cache.ready_at[0, experts] = [0.0, 1.2, 2.0, 3.0]
    busy, end, waited = run._on_arrival_time(0, experts, row, 1.0, cpu_busy=0.5)
    # as on one thread to 3.0 (the case above), then the last arrival's call on every thread
    assert (busy, end, waited) == pytest.approx((1.125, 3.0 + 0.1 + 0.125, 0.2), abs=1e-9)
    fit = dt.DiskProfileFit(compute_while_reading=True).fit(
        dt.DiskMeasurements(**{**_measurements().__dict__, "slot_seconds_all_threads": 1e-4})
    )
    assert 2 * 6 * MIB / fit.profile_.accelerator_flops_alone == pytest.approx(1e-4)


def test_a_profile_takes_one_engines_order():
    with pytest.raises(ValueError, match="set one"):
        _profile(await_all_copies=True, compute_while_reading=True)
    fit = dt.DiskProfileFit(compute_while_reading=True).fit(_measurements())
    assert fit.profile_.compute_while_reading and not fit.profile_.await_all_copies


def test_a_result_names_its_engine_and_one_without_is_the_engine_before():
    assert dt.engine_of({}) == {"checksum": "crc32", "compute_while_reading": False}
    bench = _script("larger_than_memory")
    engine = dt.engine_of({"engine": bench.engine_facts()})
    assert engine["checksum"] == "page-sum" and engine["compute_while_reading"]
    with pytest.raises(ValueError, match="known"):
        dt.engine_of({"engine": {"checksum": "md5"}})


def test_the_engine_costs_time_the_results_checksum(tmp_path):
    from moespec.offload.engine.disk import expert_checksum

    assert dt.checksum_function("page-sum") is expert_checksum
    costs = dt.measure_engine_costs(64, 32, 64 * 4096, top_k=2, repeats=3, store_experts=4)
    assert costs["checksum"] == "page-sum" and costs["checksum_seconds"] > 0
    sim = _script("simulate_disk_tier")
    earlier = tmp_path / "costs.json"
    earlier.write_text('{"engine_costs": {"slot_seconds": 1e-4}}')  # before: crc32, unnamed
    args = argparse.Namespace(costs=earlier)
    assert sim.engine_costs(args, {}, None, dt.OLD_ENGINE)["slot_seconds"] == 1e-4
    with pytest.raises(SystemExit, match="crc32 checksum"):
        sim.engine_costs(args, {}, None, {"checksum": "page-sum"})


def test_the_dense_time_pools_the_in_memory_runs_of_every_routing():
    sim = _script("simulate_disk_tier")
    results = {
        "in-memory|model": {"tokens_per_second": 15.9, "runs_tokens_per_second": [15.1, 16.7]},
        "in-memory|replay": {"tokens_per_second": 13.1, "runs_tokens_per_second": [9.9, 16.3]},
        "reference|model": {"decode_seconds": 1.0, "decode_tokens": 10},
    }
    pooled = 1 / ((15.1 + 16.3) / 2)  # the median of the four runs, whichever routing
    assert sim.reference_token_seconds({"results": results}, "replay") == pytest.approx(pooled)
    assert sim.reference_token_seconds({"results": results}, "model") == pytest.approx(pooled)
    held = {"reference|model": results["reference|model"]}  # --skip-in-memory: the one run
    assert sim.reference_token_seconds({"results": held}, "model") == pytest.approx(0.1)


def test_rounds_pair_only_where_every_held_arm_ran_once_a_round_beside_its_costs():
    sim = _script("simulate_disk_tier")
    costs = {"slot_seconds": 1e-4, "by_round": [{"slot_seconds": 1e-4}, {"slot_seconds": 2e-4}]}
    held = {"memory_condition": "held", "runs_tokens_per_second": [4.0, 5.0]}
    data = {"results": {"lru|replay": held, "in-memory|replay": {"runs_tokens_per_second": [9.0]}}}
    assert sim.paired_rounds(data, costs, "rounds") == 2
    assert sim.paired_rounds(data, costs, "pooled") == 0
    assert sim.paired_rounds(data, {"slot_seconds": 1e-4}, "rounds") == 0  # costs pooled only
    short = {
        "results": {**data["results"], "static|replay": {**held, "runs_tokens_per_second": [4.0]}}
    }
    assert sim.paired_rounds(short, costs, "rounds") == 0  # an arm missing a round


def test_a_rounds_in_memory_time_is_its_own_runs_median():
    sim = _script("simulate_disk_tier")
    results = {
        "in-memory|model": {"runs_tokens_per_second": [10.0, 16.0, 12.0]},
        "in-memory|replay": {"runs_tokens_per_second": [12.0, 14.0, 12.0]},
    }
    assert sim.reference_token_seconds({"results": results}, "model", 1) == pytest.approx(1 / 15)
    assert sim.reference_token_seconds({"results": results}, "model", 2) == pytest.approx(1 / 12)
    assert sim.reference_token_seconds({"results": results}, "model") == pytest.approx(1 / 12)


def test_a_paired_arm_is_judged_by_the_median_of_its_rounds_ratios():
    sim = _script("simulate_disk_tier")
    row = {"tokens_per_second": 10.0, "runs_tokens_per_second": [8.0, 10.0, 14.0]}

    def run(rate):  # a simulation's figures as compare() reads them
        return {"tokens": 48, "tokens_per_second": rate, "bytes_copied": 0, "cpu_experts": 0,
                "hit_rate": 1.0, "copy_wait_seconds": 0.0, "steps": 48}  # fmt: skip

    # each round's simulation tracks its round (0.95-1.05), where the median rates (11.0
    # against 10.0) or the pooled extremes would not
    paired = sim.paired_row(row, [run(8.4), run(9.5), run(14.0)], 4096, 0.2)
    assert paired["round_ratios"] == pytest.approx([1.05, 0.95, 1.0])
    assert paired["ratio"] == pytest.approx(1.0) and paired["within"]
    assert paired["simulated_tokens_per_second"] == pytest.approx(9.5)
    assert paired["measured_tokens_per_second"] == 10.0 and paired["pairing"] == "rounds"
    off = sim.paired_row(row, [run(5.0), run(7.0), run(14.0)], 4096, 0.2)  # 0.625, 0.7, 1.0
    assert off["ratio"] == pytest.approx(0.7) and not off["within"]
    with pytest.raises(ValueError, match="2 rounds simulated against 3"):
        sim.paired_row(row, [run(8.0), run(10.0)], 4096, 0.2)
