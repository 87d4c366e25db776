"""The plan's draft length per batch size: the union of B sequences' experts measured on a
trace, tau_hat_B(k) from the fits at it, the table the engine reads while a batch runs, and
vLLM's per-batch-size schedule exported from it."""

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from moespec.calibrate.batch import batch_unions, growth_slope, predict_batch
from moespec.calibrate.fits import LayerFits
from moespec.cli import main
from moespec.cli.options import batch_sizes
from moespec.costmodel import best_draft_length
from moespec.decoding.draft_policy import DraftLengthPolicy
from moespec.export.speculative import Timing, batch_schedule, export_settings
from moespec.plan import BatchTable, plan_from_dict
from moespec.routing.trace import RoutingTrace

TOP_K, EXPERTS = 2, 16
PLANS = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "plans"


def trace_of(documents: list[np.ndarray]) -> RoutingTrace:
    """A one-layer trace of the given documents ([T_d, m] expert ids each)."""
    ids = np.concatenate(documents)[:, None, :]
    starts = np.cumsum([0] + [len(d) for d in documents])
    return RoutingTrace(
        expert_ids=ids,
        doc_starts=starts,
        doc_names=[f"doc{i}" for i in range(len(documents))],
        num_experts=EXPERTS,
        expert_bytes=[1000],
        layer_indices=[0],
    )


def test_the_union_of_sequences_that_route_alike_is_their_shared_experts():
    same = np.tile([[3, 5]], (20, 1))
    unions = batch_unions(trace_of([same, same, same]), [1, 2, 3], width=4)
    for table in unions.values():
        assert np.all(table == TOP_K)


def test_the_union_of_sequences_of_disjoint_experts_adds_up():
    # document d routes every token to experts 2d and 2d + 1: B documents, 2B experts
    documents = [np.tile([[2 * d, 2 * d + 1]], (12, 1)) for d in range(4)]
    unions = batch_unions(trace_of(documents), [1, 2, 4], width=3)
    assert unions[1][0].tolist() == [2, 2, 2]
    assert unions[2][0].tolist() == [4, 4, 4]  # two different documents
    assert unions[4][0].tolist() == [8, 8, 8]


def test_batch_unions_grow_with_the_window_and_the_batch_within_their_bounds():
    rng = np.random.default_rng(1)
    documents = [
        np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(30)]) for _ in range(6)
    ]
    unions = batch_unions(trace_of(documents), [1, 2, 4, 8], width=5, draws=64)
    for batch, table in unions.items():
        row = table[0]
        assert row[0] >= TOP_K and np.all(np.diff(row) >= 0)  # prefixes of one window
        assert np.all(row <= np.minimum(EXPERTS, batch * TOP_K * np.arange(1, 6)))
    assert unions[1][0, 0] == TOP_K
    assert np.all(unions[8][0] >= unions[4][0]) and np.all(unions[4][0] >= unions[2][0])


def test_a_trace_without_a_window_of_the_width_is_refused():
    with pytest.raises(ValueError, match="window of 9 tokens"):
        batch_unions(trace_of([np.tile([[0, 1]], (4, 1))]), [2], width=9)


def test_growth_beyond_the_measured_sizes_is_the_line_through_the_first():
    assert growth_slope([0.0, 2e-4, 4e-4, 6e-4]) == pytest.approx(2e-4)
    assert growth_slope([0.0, -1e-5, -2e-5]) == 0.0  # never a pass that gets cheaper
    assert growth_slope([0.0]) == 0.0


def linear_records(layer: int, cost: dict) -> list[dict]:
    """Chosen-id passes of a layer whose expert operation costs exactly
    slot: c0 + c_u U b + c_re (n m - U) b;  dedup: d0 + c_g U b + c_t n."""
    records = []
    for n in range(2, 10):
        for distinct in range(TOP_K, min(EXPERTS, n * TOP_K) + 1, 3):
            b = 1000
            slot = cost["c0"] + cost["cu"] * distinct * b + cost["cre"] * (n * TOP_K - distinct) * b
            dedup = cost["d0"] + cost["cg"] * distinct * b + cost["ct"] * n
            for kernel, median in (("slot", slot), ("dedup", dedup)):
                records.append(
                    {
                        "kernel": kernel,
                        "design": "chosen",
                        "layer": layer,
                        "n_tokens": n,
                        "distinct": distinct,
                        "expert_bytes": b,
                        "median": median,
                    }
                )
    return records


COST = {"c0": 1e-5, "cu": 2e-9, "cre": 1.5e-9, "d0": 3e-5, "cg": 2.2e-9, "ct": 4e-6}


def test_batch_verify_times_are_the_chain_at_the_batch_union():
    fits = LayerFits.fit(linear_records(0, COST), TOP_K, ("slot", "dedup"), per_layer=False)
    union = np.array([[2.0, 3.5, 5.0]])  # U^B(w), w = 1..3, one layer
    plain, growth = 1e-3, [0.0, 1e-5, 2e-5]
    predicted = predict_batch(fits, [0], [1000], TOP_K, {2: union}, plain, growth, crossover=4)
    b = 1000

    def slot(n, u):
        return COST["c0"] + COST["cu"] * u * b + COST["cre"] * (n * TOP_K - u) * b

    def dedup(n, u):
        return COST["d0"] + COST["cg"] * u * b + COST["ct"] * n

    one = slot(1, TOP_K)
    # B = 2: passes of n = 2, 4, 6 tokens; deduplication from the crossover n = 4 on; the
    # growth outside the experts is measured at n = 2 and extrapolated (1e-5 / token) beyond
    expected = [
        plain + slot(2, 2.0) - one + 1e-5,
        plain + dedup(4, 3.5) - one + 3e-5,
        plain + dedup(6, 5.0) - one + 5e-5,
    ]
    assert predicted.verify_time[2] == pytest.approx(expected, rel=1e-6)
    assert predicted.kernel[2] == ["slot", "dedup", "dedup"]
    assert predicted.step_times(2) == pytest.approx([t / 2 for t in expected], rel=1e-6)
    table = predicted.best_draft_lengths([0.5, 0.9])
    assert table["0.9"][2] == best_draft_length(predicted.step_times(2), 0.9)


def batch_table() -> BatchTable:
    return BatchTable(
        batch_sizes=[1, 2, 4],
        verify_time={1: [1.0, 1.1, 1.2], 2: [1.1, 1.4, 1.8], 4: [1.3, 2.2, 3.4]},
        kernel={b: ["slot"] * 3 for b in (1, 2, 4)},
        union={b: [2.0, 3.0, 4.0] for b in (1, 2, 4)},
        growth_slope=0.0,
        best_draft_length={"0.8": {1: 2, 2: 1, 4: 0}},
    )


def test_a_batch_size_between_the_tables_rows_is_interpolated():
    table = batch_table()
    assert table.verify_times(2) == [1.1, 1.4, 1.8]
    assert table.verify_times(3) == pytest.approx([1.2, 1.8, 2.6])
    assert table.verify_times(5) is None  # beyond the largest: measured online instead


def test_the_policy_reads_the_plans_batch_row_while_the_batch_runs():
    table = batch_table()
    policy = DraftLengthPolicy(
        "auto", verify_times=table.verify_time[1], batch_verify_times=table.verify_times
    )
    policy.accepted, policy.rejected = 90.0, 10.0  # a = 0.9
    assert policy.step_times() == pytest.approx([1.0, 1.1, 1.2])
    policy.batch = 4
    share = [t / 4 for t in table.verify_time[4]]
    assert policy.step_times() == pytest.approx(share)
    assert policy.plan().draft_length == best_draft_length(share, 0.9)
    policy.batch = 2
    assert policy.plan().draft_length == best_draft_length([t / 2 for t in [1.1, 1.4, 1.8]], 0.9)


def test_the_plan_keeps_its_batch_table_and_refuses_a_broken_one():
    plan = plan_from_dict(json.loads((PLANS / "demo-bf16" / "plan.json").read_text()))
    assert plan.batch is None  # made before batched decoding: read without a table
    plan.batch = batch_table()
    data = plan.to_dict()
    again = plan_from_dict(json.loads(json.dumps(data)))
    assert again.batch == plan.batch
    policy = again.draft_policy(max_draft_length=2)  # what generate, serve and auto build
    policy.batch = 4
    assert policy.step_times() == pytest.approx([t / 4 for t in batch_table().verify_time[4]])
    data["batch"]["verify_time"]["4"] = [1.3, -1.0, 3.4]
    with pytest.raises(ValueError, match="batch.verify_time"):
        plan_from_dict(data).check("plan.json")


def timing_with_batch(rows: dict) -> Timing:
    return Timing(
        engine="moespec",
        verify_time=rows[1],
        draft_time=[0.0] * len(rows[1]),
        draft=None,
        acceptance=None,
        bandwidth_error=0.02,
        facts={},
        batch_verify=rows,
    )


def test_vllm_gets_a_draft_length_per_batch_size_from_the_table():
    rows = {1: [1.0, 1.1, 1.2, 1.3], 2: [1.1, 1.9, 2.7, 3.5], 4: [1.3, 2.6, 3.9, 5.2]}
    document = export_settings(timing_with_batch(rows), "vllm", drafter="lookup", acceptance=0.8)
    config = document["speculative_config"]
    expected = [best_draft_length([t / b for t in rows[b]], 0.8) for b in (1, 2, 4)]
    assert expected == [3, 1, 0]  # dearer shared passes: shorter drafts as the batch grows
    schedule = config["num_speculative_tokens_per_batch_size"]
    assert schedule == [[1, 1, 3], [2, 3, 1], [4, 4, 0]]
    # vLLM's documented rules: [first, last, K] ranges from 1, sorted, without overlap, and
    # no K above num_speculative_tokens (the draft window)
    assert schedule[0][0] == 1 and config["num_speculative_tokens"] == max(expected)
    assert all(a[1] < b[0] for a, b in zip(schedule, schedule[1:], strict=False))
    assert all(lo <= hi and 0 <= k <= config["num_speculative_tokens"] for lo, hi, k in schedule)
    by_batch = document["predicted"]["by_batch_size"]
    assert [row["draft_length"] for row in by_batch] == expected
    assert by_batch[2]["speedup"] == 1.0


def test_equal_neighbours_share_one_range_and_no_table_exports_none():
    assert batch_schedule([1, 2, 4, 8], [3, 3, 1, 1]) == [[1, 3, 3], [4, 8, 1]]
    flat = {1: [1.0, 1.1, 1.2], 2: [1.1, 1.2, 1.3]}
    document = export_settings(timing_with_batch(flat), "vllm", drafter="lookup", acceptance=0.8)
    assert "num_speculative_tokens_per_batch_size" not in document["speculative_config"]
    plain = replace(timing_with_batch(flat), batch_verify=None)
    document = export_settings(plain, "vllm", drafter="lookup", acceptance=0.8)
    assert "by_batch_size" not in document["predicted"]


@pytest.mark.parametrize("text", ["0,2", "2,2", "a,b", ""])
def test_bad_batch_sizes_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        batch_sizes(text)


def test_batch_sizes_flag_is_read_sorted():
    assert batch_sizes("8,1,4,2") == (1, 2, 4, 8)
    assert main(["plan", "--batch-sizes", "0", "--out", "x"]) != 0
