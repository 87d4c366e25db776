"""Continuous batching and batch files: sequences decoded together, each exactly as alone."""

import json

import pytest

from moespec.cli import main
from moespec.decoding import DraftLengthPolicy, PromptLookupDrafter, Sampler, generate
from moespec.decoding.batch import BatchRequest, decode_batch
from moespec.decoding.speculation import Speculation
from moespec.models import load_model

PROMPTS = [[5, 17, 33, 2, 5, 17], [40, 41], [7, 7, 8, 9, 10, 11, 12, 7, 7], [3], [60, 61, 62]]
BUDGETS = [12, 7, 15, 9, 5]


@pytest.fixture(scope="module", params=["bf16", "fp32"])
def target(checkpoint_dir, request):
    model, _ = load_model(checkpoint_dir("qwen3_moe")[0], dtype=request.param)
    model.batch_invariant = True
    return model


def alone(model, prompt, max_tokens, sampler=None) -> list[int]:
    records = generate(model, prompt, max_tokens=max_tokens, sampler=sampler or Sampler())
    return [t for r in records for t in r.tokens]


def batched(model, requests, max_batch) -> dict:
    out = {}
    for key, record in decode_batch(model, requests, max_batch=max_batch):
        out.setdefault(key, []).extend(record.tokens)
    return out


@pytest.mark.parametrize("max_batch", [1, 2, 5])
def test_greedy_sequences_decode_together_as_they_do_alone(target, max_batch):
    requests = [
        BatchRequest(i, prompt, budget)
        for i, (prompt, budget) in enumerate(zip(PROMPTS, BUDGETS, strict=True))
    ]
    tokens = batched(target, requests, max_batch)
    for i, (prompt, budget) in enumerate(zip(PROMPTS, BUDGETS, strict=True)):
        assert tokens[i] == alone(target, prompt, budget), i


def test_keyed_samples_are_the_same_in_a_batch(target):
    def sampler(i):
        return Sampler(1.0, 0.9, seed=100 + i, keyed=True)

    requests = [BatchRequest(i, p, 10, sampler(i)) for i, p in enumerate(PROMPTS)]
    tokens = batched(target, requests, 3)
    for i, prompt in enumerate(PROMPTS):
        assert tokens[i] == alone(target, prompt, 10, sampler(i)), i


def test_speculating_sequences_in_a_batch_decode_as_plain_greedy(target):
    def lookup():  # a fixed k: drafts in most steps
        return Speculation.single(PromptLookupDrafter(), DraftLengthPolicy(3))

    requests = [BatchRequest(i, p, 14, drafter=lookup()) for i, p in enumerate(PROMPTS)]
    records = list(decode_batch(target, requests, max_batch=4))
    tokens = {}
    for key, record in records:
        tokens.setdefault(key, []).extend(record.tokens)
    for i, prompt in enumerate(PROMPTS):
        assert tokens[i] == alone(target, prompt, 14), i
    assert any(record.drafted for _, record in records)


def test_max_batch_below_one_is_refused(target):
    with pytest.raises(ValueError, match="max_batch"):
        list(decode_batch(target, [BatchRequest(0, [1], 2)], max_batch=0))


# -- batch files -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(checkpoint_dir):
    return str(checkpoint_dir("qwen3_moe")[0])


def write_lines(path, lines) -> None:
    path.write_text("\n".join(json.dumps(x) if not isinstance(x, str) else x for x in lines))


def rows_of(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def expected_text(model_dir, prompt: str, max_tokens: int) -> str:
    model, tokenizer = load_model(model_dir, dtype="bf16")
    model.batch_invariant = True
    return tokenizer.decode(alone(model, tokenizer.encode(prompt), max_tokens))


def test_a_batch_file_writes_each_result_and_names_bad_lines(model_dir, tmp_path, capsys):
    batch, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [
        {"prompt": "w1 w2 w3", "id": "a", "max_tokens": 6},
        "{not json",
        {"prompt": "w4 w5", "max_tokens": "6"},
        {"prompt": " ".join(["w1"] * 600)},  # over the checkpoint's 512 positions
        {"prompt": "w9 w8 w7 w9", "max_tokens": 4, "id": 7},
    ]
    write_lines(batch, lines)
    args = ["generate", "--model", model_dir, "--batch", str(batch), "--out", str(out)]
    assert main([*args, "--max-batch", "2"]) == 0
    header, *rows = rows_of(out)
    assert header["batch"] == "moespec-batch/1"
    by_line = {row["line"]: row for row in rows}
    assert sorted(by_line) == [1, 2, 3, 4, 5]
    assert by_line[1]["text"] == expected_text(model_dir, "w1 w2 w3", 6)
    assert by_line[5]["text"] == expected_text(model_dir, "w9 w8 w7 w9", 4)
    assert by_line[1]["id"] == "a" and by_line[5]["id"] == 7
    assert "line 2" in by_line[2]["error"]
    assert "line 3: max_tokens" in by_line[3]["error"]
    assert "line 4" in by_line[4]["error"] and "context" in by_line[4]["error"]
    assert "line 2" in capsys.readouterr().err


def test_an_interrupted_batch_resumes_with_only_the_missing_lines(model_dir, tmp_path):
    from moespec.batchfile import BatchSettings, run_batch_file

    batch, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(batch, [{"prompt": f"w{i} w{i + 1}", "max_tokens": 3 + i} for i in range(1, 6)])
    settings = BatchSettings(model=model_dir, max_batch=2)
    seen = []

    def stop_after_two(row):
        seen.append(row["line"])
        if len(seen) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_batch_file(batch, out, settings, on_result=stop_after_two)
    with out.open("a") as torn:
        torn.write('{"line": 9, "te')  # a write the interruption cut short
    counts = run_batch_file(batch, out, settings)
    assert counts["resumed"] == 2 and counts["finished"] == 3
    lines = [row["line"] for row in rows_of(out)[1:]]
    assert sorted(lines) == [1, 2, 3, 4, 5]  # each once; the torn line gone


def test_results_of_another_batch_file_are_not_overwritten(model_dir, tmp_path, capsys):
    from moespec.batchfile import BatchSettings, run_batch_file

    first, second, out = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "out.jsonl"
    write_lines(first, [{"prompt": "w1", "max_tokens": 2}])
    write_lines(second, [{"prompt": "w2", "max_tokens": 2}])
    run_batch_file(first, out, BatchSettings(model=model_dir))
    before = out.read_text()
    args = ["generate", "--model", model_dir, "--batch", str(second), "--out", str(out)]
    assert main(args) == 2
    assert "another batch file" in capsys.readouterr().err and out.read_text() == before
    assert main([*args, "--force"]) == 0
    assert rows_of(out)[1]["line"] == 1 and out.read_text() != before


def test_a_batch_needs_an_output(tmp_path, capsys):
    batch = tmp_path / "in.jsonl"
    write_lines(batch, [{"prompt": "w1"}])
    assert main(["generate", "--batch", str(batch)]) == 2
    assert "--out" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [["a prompt"], ["--compare-plain"], ["--offload", "lru"]])
def test_settings_of_one_generation_do_not_go_with_a_batch(model_dir, tmp_path, capsys, extra):
    batch = tmp_path / "in.jsonl"
    write_lines(batch, [{"prompt": "w1"}])
    args = ["generate", "--model", model_dir, "--batch", str(batch), "--out", str(tmp_path / "o")]
    assert main([*args, *extra]) == 2
    assert "does not go with --batch" in capsys.readouterr().err


def test_an_empty_batch_file_is_refused(model_dir, tmp_path, capsys):
    batch = tmp_path / "in.jsonl"
    batch.write_text("\n\n")
    args = ["generate", "--model", model_dir, "--batch", str(batch)]
    assert main([*args, "--out", str(tmp_path / "o.jsonl")]) == 2
    assert "has no prompts" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def test_a_batch_prices_drafts_at_each_sequences_share_of_the_batch_pass():
    """k*(a, B): V(k) = tau(B (k + 1)) / B. A pass whose time grows with its tokens past
    the batch's first few makes long drafts dear in a batch, while alone they pay."""
    from moespec.decoding.draft_policy import DraftLengthPolicy, RunningMedians, _best_in_floats

    verify = RunningMedians()
    # tau(n): flat up to 4 tokens (the bytes dominate), then 0.25 a token (compute)
    verify.seed({n: max(1.0, 0.25 * n) for n in range(1, 73)})
    policy = DraftLengthPolicy("auto", max_draft_length=8, measured_verify=verify)
    alone = policy.step_times()
    policy.batch = 4
    in_batch = policy.step_times()
    assert in_batch[1] == pytest.approx(max(1.0, 0.25 * 8) / 4)  # tau(8) / 4
    assert in_batch[0] == pytest.approx(1.0 / 4)
    k_alone, _ = _best_in_floats(alone, 0.8)
    k_batch, _ = _best_in_floats(in_batch, 0.8)
    # alone, 3 drafts ride on the flat part; in a batch of 4 every token costs 0.25: none pays
    assert k_alone == 3 and k_batch == 0
