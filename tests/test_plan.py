"""The plan's schema: typed round trip, the /1 files lifted to /2, one-line refusals."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from moespec.plan import (
    PLAN_FORMAT,
    SHAPE_PLAN_FORMAT,
    Plan,
    ShapePlan,
    load_plan,
    plan_from_dict,
    read_plan,
)

PLANS = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "plans"


def committed(name: str) -> dict:
    return json.loads((PLANS / name / "plan.json").read_text())


def test_a_version_1_checkpoint_plan_reads_as_a_plan_with_its_provenance():
    data = committed("demo-bf16")
    assert data["format"] == "moespec-plan/1"
    plan = plan_from_dict(data)
    assert isinstance(plan, Plan) and plan.format == PLAN_FORMAT
    assert plan.provenance.device == data["device"]
    assert plan.provenance.versions == data["versions"]
    assert plan.kernel.crossover == data["kernel"]["crossover"]
    assert plan.bandwidth_ratio["dedup"][2] == data["bandwidth_ratio"]["dedup"]["2"]
    calibrated = data["predictions"]["calibrated"]["staircase"]["by_acceptance"]["0.8"]
    entry = plan.predictions["calibrated"].staircase.by_acceptance["0.8"]
    assert entry.best_draft_length == calibrated["best_draft_length"]


def test_a_version_1_shape_plan_reads_as_a_shape_plan():
    data = committed("qwen3-30b-a3b-bf16")
    assert data["kind"] == "shape"
    plan = plan_from_dict(data)
    assert isinstance(plan, ShapePlan) and plan.format == SHAPE_PLAN_FORMAT
    assert plan.expert_saving == data["expert_saving"]


@pytest.mark.parametrize("name", sorted(p.name for p in PLANS.iterdir()))
def test_every_committed_plan_survives_a_json_round_trip(name):
    plan = read_plan(PLANS / name / "plan.json")
    again = plan_from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan and type(again) is type(plan)


def test_load_plan_refuses_a_shape_plan(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(committed("olmoe-1b-7b-bf16")))
    with pytest.raises(ValueError, match="is a shape plan"):
        load_plan(path)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda p: p.update(format="moespec-plan/3"), "format 'moespec-plan/3'"),
        (lambda p: p.update(colour="blue"), "unknown key 'colour'"),
        (lambda p: p["kernel"].pop("dedup_kernel"), "has no 'kernel.dedup_kernel'"),
        (lambda p: p["kernel"].update(crossover="3"), "kernel.crossover must be of type int"),
        (lambda p: p.update(fits=[]), "fits must be an object"),
        (lambda p: p["bandwidth"]["slot"].update(x=1.0), "key 'x' that is not a pass size"),
    ],
)
def test_a_wrong_plan_is_refused_in_one_line(tmp_path, change, message):
    data = plan_from_dict(committed("olmoe4L-fp32")).to_dict()
    change(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message) as error:
        read_plan(path)
    assert "\n" not in str(error.value) and str(path) in str(error.value)


def test_the_plan_builds_the_kernel_policy_at_its_crossover():
    plan = plan_from_dict(committed("demo-bf16"))
    policy = plan.kernel_policy()
    c = plan.kernel.crossover
    assert policy.for_pass(c) == "dedup" and policy.for_pass(c - 1) == "slot"
    assert plan.kernel_policy(crossover=c + 1).for_pass(c) == "slot"
    assert plan.kernel_policy("slot").for_pass(9) == "slot"


def test_the_plan_builds_the_draft_policy_on_its_verify_times():
    from moespec.demo import demo_paths, describe

    target, draft = demo_paths()
    measured = plan_from_dict(committed("demo-bf16"))
    plan = replace(measured, draft_dir=describe(draft), draft_time=[1e-3] * 9)
    with_draft = plan.draft_policy(draft)
    without = plan.draft_policy(target)  # not the draft the plan measured
    assert plan.measured_draft(draft) and not plan.measured_draft(target)
    assert with_draft.step_times()[1] == pytest.approx(plan.verify_time[1] + plan.draft_time[1])
    assert without.step_times()[1] == pytest.approx(plan.verify_time[1])
