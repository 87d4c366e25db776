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
