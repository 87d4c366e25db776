"""`moespec measure-verify`: the command runs the library's one call (calibrate.verify
.verify_run) and writes every sample, once."""

import json

from moespec.cli import main


def test_measure_verify_writes_every_sample_and_keeps_an_existing_file(
    capsys, checkpoint_dir, tmp_path
):
    model, _ = checkpoint_dir("qwen3_moe")
    out = tmp_path / "verify.json"
    argv = ["measure-verify", "--model", str(model), "--dtype", "fp32", "--max-n", "3"]
    argv += ["--depth", "8", "--repeats", "2", "--out", str(out)]
    capsys.readouterr()
    assert main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    result = json.loads(out.read_text())
    records = {(r["kernel"], r["n_tokens"]): r for r in result["records"]}
    assert set(records) == {(k, n) for k in ("slot", "dedup") for n in (1, 2, 3)}
    assert all(len(r["seconds"]) == 2 and r["depth"] == 8 for r in records.values())
    assert result["text"] == "the test documents of moespec.calibrate.texts"
    assert result["provenance"]["settings"] == {"kernels": ["slot", "dedup"], "repeats": 2}
    assert [line.split()[0] for line in printed[1:]] == ["1", "2", "3"]  # one row per n
    before = out.read_bytes()
    assert main(argv) == 2  # no --force: refused, the first result kept
    assert "exists" in capsys.readouterr().err and out.read_bytes() == before


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
    measure_verify(model, list(range(20)), depth=8, pass_sizes=(1, 2, 3), repeats=3, warmup=1)
    cells = {(n, k) for n in (1, 2, 3) for k in ("slot", "dedup")}
    rounds = [seen[i : i + 6] for i in range(0, len(seen), 6)]
    assert len(rounds) == 4 and all(set(r) == cells for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1
