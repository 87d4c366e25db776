"""benchmarks/larger_than_memory.py's memory condition: what the helper holds, and the
budgets and holds it refuses."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30


@pytest.fixture(scope="module")
def bench():
    path = ROOT / "benchmarks" / "larger_than_memory.py"
    spec = importlib.util.spec_from_file_location("larger_than_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_auto_holds_what_is_available_beyond_budget_dense_and_margin(bench):
    held = bench.hold_bytes("auto", 20 * GIB, budget=4 * GIB, dense=GIB, margin=GIB)
    assert held == 14 * GIB
    assert bench.hold_bytes("auto", 5 * GIB, budget=4 * GIB, dense=GIB, margin=GIB) == 0
    assert bench.hold_bytes("none", 20 * GIB, budget=4 * GIB, dense=GIB, margin=GIB) == 0


def test_a_hold_beyond_available_memory_or_the_arms_room_is_refused(bench):
    assert bench.hold_bytes("10G", 20 * GIB, budget=4 * GIB, dense=GIB, margin=GIB) == 10 * GIB
    with pytest.raises(bench.Refused, match="more than the 20.0 GiB available"):
        bench.hold_bytes("21G", 20 * GIB, budget=4 * GIB, dense=GIB, margin=GIB)
    with pytest.raises(bench.Refused, match="leaves 4.00 GiB"):
        bench.hold_bytes("16G", 20 * GIB, budget=4 * GIB, dense=GIB, margin=GIB)


def test_a_budget_is_a_size_or_a_share_of_the_experts(bench):
    assert bench.parse_budget("40%", 1000) == 400
    assert bench.parse_budget("2M", 1000) == 2 << 20
    with pytest.raises(bench.Refused, match="share in"):
        bench.parse_budget("140%", 1000)


def test_an_arm_is_a_policy_with_or_without_a_draft(bench):
    assert bench.parse_arm("spac+draft") == {
        "name": "spac+draft",
        "kind": "disk",
        "policy": "spac",
        "draft": True,
    }
    assert bench.parse_arm("llama.cpp")["kind"] == "llama.cpp"
    with pytest.raises(bench.Refused, match="without a draft"):
        bench.parse_arm("spac-ar+draft")


def test_the_engine_costs_of_every_round_are_pooled_by_median(bench):
    runs = [
        {"slot_seconds": s, "call_seconds": c, "checksum_seconds": k, "kernel": "slot",
         "medians_seconds": {"one": s + c, "call": 8 * s + c}}
        for s, c, k in [(3e-4, 2e-4, 4e-4), (5e-4, 1e-4, 3e-4), (4e-4, 3e-4, 5e-4)]
    ]  # fmt: skip
    costs = bench.median_costs(runs)
    assert (costs["slot_seconds"], costs["call_seconds"]) == (4e-4, 2e-4)
    assert costs["checksum_seconds"] == 4e-4 and costs["kernel"] == "slot"
    assert costs["medians_seconds"]["one"] == pytest.approx(6e-4)  # each figure its own median
    assert [r["slot_seconds"] for r in costs["by_round"]] == [3e-4, 5e-4, 4e-4]
