"""benchmarks/real_draft_eval.py's held-out noise ceiling: the share of prompts on which plain
measured again comes within 5% of plain on the scoring rounds."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    path = ROOT / "benchmarks" / "real_draft_eval.py"
    spec = importlib.util.spec_from_file_location("real_draft_eval", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def prompt(plain, again):
    return {"tokens_per_second_by_round": {"plain": plain, "plain-b": again}}


def test_ceiling_counts_prompts_whose_repeat_is_within_5pct_on_the_scoring_rounds(bench):
    prompts = [
        prompt([10, 10, 10, 10], [1, 10, 1, 10]),  # even rounds far off, odd ones equal: in
        prompt([10, 10, 10, 10], [10, 9.4, 10, 9.4]),  # 0.94 on the scoring rounds: out
        prompt([10, 10, 10, 10], [10, 9.6, 10, 9.6]),  # 0.96: in
        prompt([10, 10, 10, 10], [10, 12, 10, 12]),  # faster again: in
    ]
    assert bench.held_out_noise_ceiling(prompts) == 0.75


def test_ceiling_needs_a_scoring_round(bench):
    assert bench.held_out_noise_ceiling([prompt([10], [10])]) is None


def test_rescore_adds_the_ceiling_and_keeps_the_rest(bench, tmp_path):
    path = tmp_path / "result.json"
    result = {"scores": {"kept": 1}, "prompts": [prompt([10, 10], [10, 8])], "other": [1, 2]}
    path.write_text(json.dumps(result))
    bench.rescore(path)
    again = json.loads(path.read_text())
    assert again["scores"] == {"kept": 1, "held_out_noise_ceiling": 0.0}
    assert again["other"] == [1, 2] and again["prompts"] == result["prompts"]
