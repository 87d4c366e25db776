"""`moespec measure-verify`: the command runs the library's one call (calibrate.verify
.verify_run) and writes every sample, once."""

import json

import pytest

from moespec.cli import main


def test_measure_verify_writes_every_sample_and_keeps_an_existing_file(
    capsys, checkpoint_dir, tmp_path
):
    model, _ = checkpoint_dir("qwen3_moe")
    out = tmp_path / "verify.json"
    argv = ["measure-verify", "--model", str(model), "--dtype", "fp32", "--max-n", "3"]
    argv += ["--depth", "16", "--repeats", "2", "--out", str(out)]
    capsys.readouterr()
    assert main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    result = json.loads(out.read_text())
    records = {(r["kernel"], r["n_tokens"]): r for r in result["records"]}
    assert set(records) == {(k, n) for k in ("slot", "dedup") for n in (1, 2, 3)}
    assert all(len(r["seconds"]) == 2 and r["depth"] == 16 for r in records.values())
    assert all(r["mode"] == "stream" for r in records.values())
    assert result["text"] == "continuations"  # as `plan` times its verify passes
    settings = {"kernels": ["slot", "dedup"], "repeats": 2, "verify_mode": "stream"}
    settings["batch_invariant"] = True  # as `generate` verifies by default
    assert result["provenance"]["settings"] == settings
    assert [line.split()[0] for line in printed[1:]] == ["1", "2", "3"]  # one row per n
    before = out.read_bytes()
    assert main(argv) == 2  # no --force: refused, the first result kept
    assert "exists" in capsys.readouterr().err and out.read_bytes() == before


@pytest.mark.parametrize("invariant", [True, False])
def test_passes_run_batch_invariant_unless_told_otherwise(checkpoint_dir, monkeypatch, invariant):
    """The whole-model passes are timed as decoding verifies (batch-invariant by default):
    where a product has no batch-invariant multi-row form, that is what a pass costs."""
    from moespec.calibrate.verify import verify_run
    from moespec.models.transformer import Transformer

    seen = set()
    forward = Transformer.__call__

    def recording(self, tokens, cache, **kwargs):
        seen.add(self.batch_invariant)
        return forward(self, tokens, cache, **kwargs)

    monkeypatch.setattr(Transformer, "__call__", recording)
    model = checkpoint_dir("qwen3_moe")[0]
    result = verify_run(
        model, dtype="fp32", max_n=2, depth=16, repeats=1, batch_invariant=invariant
    )
    assert seen == {invariant}
    assert result["provenance"]["settings"]["batch_invariant"] is invariant


def test_each_round_times_every_pass_once_in_an_order_of_its_own(checkpoint_dir, monkeypatch):
    """A fixed order made the first pass of every round the slow one (12-22% on the demo):
    each round visits every (n, kernel) once, and the rounds' orders differ."""
    from moespec.calibrate.verify import measure_verify
    from moespec.models import load_model

    model, tokenizer = load_model(checkpoint_dir("qwen3_moe")[0], dtype="fp32")
    seen = []
    forward = type(model).__call__

    def recording(self, tokens, cache, **kwargs):
        if cache.length == 8:  # a timed pass on the 8-token context (not the prefill)
            seen.append((tokens.shape[-1], kwargs["kernel"]))
        return forward(self, tokens, cache, **kwargs)

    monkeypatch.setattr(type(model), "__call__", recording)
    measure_verify(
        model,
        list(range(20)),
        depth=8,
        pass_sizes=(1, 2, 3),
        repeats=3,
        warmup=1,
        mode="isolated",  # one pass per cell, at the depth (the order is the same in "stream")
    )
    cells = {(n, k) for n in (1, 2, 3) for k in ("slot", "dedup")}
    rounds = [seen[i : i + 6] for i in range(0, len(seen), 6)]
    assert len(rounds) == 4 and all(set(r) == cells for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1


def recorded_passes(model, monkeypatch, slow_first: float = 0.0):
    """[(cache length, tokens, kernel)] of every pass `model` runs from now on; the first
    sleeps `slow_first` seconds inside the pass (so its time shows in what is timed)."""
    import time

    seen = []
    forward = type(model).__call__

    def recording(self, tokens, cache, **kwargs):
        seen.append((cache.length, tokens.tolist(), kwargs["kernel"]))
        if len(seen) == 1:
            time.sleep(slow_first)
        return forward(self, tokens, cache, **kwargs)

    monkeypatch.setattr(type(model), "__call__", recording)
    return seen


def test_a_stream_value_times_consecutive_passes_centred_on_the_depth(checkpoint_dir, monkeypatch):
    """ "stream": passes + 1 passes of n tokens stepping through the text, centred on the depth,
    the first untimed; the cache left holding the text up to the depth, as before."""
    import torch

    from moespec.calibrate.verify import time_pass
    from moespec.models import load_model

    model, _ = load_model(checkpoint_dir("qwen3_moe")[0], dtype="fp32")
    text = list(range(3, 40))
    cache = model.new_cache(capacity=40)
    model(torch.tensor(text[:16]), cache, kernel="dedup")
    seen = recorded_passes(model, monkeypatch, slow_first=0.5)
    seconds = time_pass(model, cache, text, 16, 3, "slot", mode="stream", passes=4)
    # 5 passes x 3 tokens = 15 positions from 16 - 7 = 9: 9..23, around the depth of 16
    assert [(length, tokens) for length, tokens, _ in seen] == [
        (at, text[at : at + 3]) for at in (9, 12, 15, 18, 21)
    ]
    assert {kernel for *_, kernel in seen} == {"slot"}
    assert seconds < 0.25  # the slow first pass was not timed
    assert cache.length == 16
    # the cache still holds exactly text[:16]: the next pass sees what a fresh prefill gives
    fresh = model.new_cache(capacity=40)
    model(torch.tensor(text[:16]), fresh, kernel="dedup")
    after = model(torch.tensor(text[16:19]), cache, kernel="slot", all_logits=True)
    expected = model(torch.tensor(text[16:19]), fresh, kernel="slot", all_logits=True)
    torch.testing.assert_close(after, expected)


def test_an_isolated_value_is_one_pass_at_the_depth(checkpoint_dir, monkeypatch):
    import torch

    from moespec.calibrate.verify import time_pass
    from moespec.models import load_model

    model, _ = load_model(checkpoint_dir("qwen3_moe")[0], dtype="fp32")
    text = list(range(3, 40))
    cache = model.new_cache(capacity=40)
    model(torch.tensor(text[:16]), cache, kernel="dedup")
    seen = recorded_passes(model, monkeypatch, slow_first=0.3)
    seconds = time_pass(model, cache, text, 16, 3, "dedup", mode="isolated")
    assert seen == [(16, text[16:19], "dedup")] and seconds >= 0.3
    assert cache.length == 16


def test_a_measurement_outside_the_text_is_refused(checkpoint_dir):
    import pytest
    import torch

    from moespec.calibrate.verify import pass_span, time_pass
    from moespec.models import load_model

    assert pass_span(16, 3, "stream", 6) == (6, 27)
    model, _ = load_model(checkpoint_dir("qwen3_moe")[0], dtype="fp32")
    cache = model.new_cache(capacity=40)
    model(torch.tensor(list(range(8))), cache, kernel="dedup")
    with pytest.raises(ValueError, match="positions -2..19, outside the 20 tokens"):
        time_pass(model, cache, list(range(20)), 8, 3, "slot", passes=6)
    with pytest.raises(ValueError, match="verify mode 'alone'"):
        pass_span(8, 1, "alone")


def test_the_verify_text_is_plans_continuation_or_the_documents(checkpoint_dir, monkeypatch):
    from moespec.calibrate import texts
    from moespec.calibrate.verify import pass_span, verify_run
    from moespec.errors import SettingError

    model = checkpoint_dir("qwen3_moe")[0]
    asked = []
    chosen = texts.verify_tokens

    def recording(model, tokenizer, kind, first, end, progress):
        asked.append((kind, first, end))
        return chosen(model, tokenizer, kind, first, end, progress)

    monkeypatch.setattr(texts, "verify_tokens", recording)
    common = dict(dtype="fp32", max_n=2, depth=16, repeats=1)
    assert verify_run(model, **common)["text"] == "continuations"
    documents = verify_run(model, **common, verify_text_kind="documents")
    assert documents["text"] == "documents"
    span = pass_span(16, 2)  # plan's span: the stream passes of max_n at depth
    assert asked == [("continuations", *span), ("documents", *span)]
    with pytest.raises(SettingError, match="not a verify text"):
        verify_run(model, **common, verify_text_kind="poems")
