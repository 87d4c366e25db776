"""The `moespec generate` command on a tiny checkpoint."""

import json
import statistics

import pytest

from moespec.cli import main


def test_json_contract(checkpoint_dir, capsys):
    directory, _ = checkpoint_dir("qwen3_moe")
    code = main(
        [
            "generate",
            "--model",
            str(directory),
            "w1 w2 w3",
            "--max-tokens",
            "4",
            "--dtype",
            "fp32",
            "--json",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    result = json.loads(out)
    assert result["prompt_tokens"] == [1, 2, 3]
    assert len(result["tokens"]) == 4
    assert result["text"] == " ".join(f"w{t}" for t in result["tokens"])
    assert result["tokens_per_second"] > 0
    assert [s["phase"] for s in result["steps"]] == ["prefill"] + ["decode"] * 3


def test_streams_text_and_reports_on_stderr(checkpoint_dir, capsys):
    directory, _ = checkpoint_dir("mixtral")
    assert main(["generate", "--model", str(directory), "w5 w6", "--max-tokens", "3"]) == 0
    captured = capsys.readouterr()
    assert captured.out.count("w") == 3
    assert "tokens/s" in captured.err


def test_bad_model_directory_is_one_line_and_exit_2(tmp_path, capsys):
    code = main(["generate", "--model", str(tmp_path / "none"), "hello"])
    err = capsys.readouterr().err
    assert code == 2 and "is not a checkpoint directory" in err and err.count("\n") == 1


def test_bad_numbers_exit_2(checkpoint_dir, capsys):
    directory, _ = checkpoint_dir("qwen3_moe")
    assert main(["generate", "--model", str(directory), "w1", "--max-tokens", "0"]) == 2
    assert main(["generate", "--model", str(directory), "w1", "--temperature", "-1"]) == 2
    assert main(["generate", "--model", str(directory), "w1", "--crossover", "0"]) == 2


def test_speculative_json_reports_drafts_and_plain_speedup(checkpoint_dir, capsys):
    directory, _ = checkpoint_dir("qwen3_moe")
    code = main(
        [
            "generate",
            "--model",
            str(directory),
            "w1 w2 w3 w1 w2",
            "--max-tokens",
            "12",
            "--dtype",
            "fp32",
            "--draft",
            "oracle:0.8",
            "--draft-length",
            "3",
            "--compare-plain",
            "--json",
        ]
    )
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    assert result["same_tokens_as_plain"] is True
    rounds = result["compare"]["rounds"]
    assert len(rounds) == 3 and all(r["same_tokens"] for r in rounds)
    for r in rounds:  # each round's ratio is its own two arms' tokens/s
        assert r["ratio"] == pytest.approx(r["tokens_per_second"] / r["plain_tokens_per_second"])
    assert result["speedup"] == pytest.approx(statistics.median(r["ratio"] for r in rounds))
    assert result["compare"]["speedup_range"] == [
        min(r["ratio"] for r in rounds),
        max(r["ratio"] for r in rounds),
    ]
    decode = [s for s in result["steps"] if s["phase"] == "decode"]
    assert decode[0]["draft_length"] == 3  # later steps are capped by the token budget
    assert all(s["draft_length"] <= 3 for s in decode)
    assert all(s["n_tokens"] == s["drafted"] + 1 for s in decode)


def test_draft_model_directory_and_lookup(checkpoint_dir, capsys):
    target, _ = checkpoint_dir("qwen3_moe")
    draft, _ = checkpoint_dir("qwen3")
    for spec in (str(draft), "lookup"):
        assert (
            main(
                [
                    "generate",
                    "--model",
                    str(target),
                    "w1 w2 w1",
                    "--max-tokens",
                    "6",
                    "--draft",
                    spec,
                ]
            )
            == 0
        )
        assert "accepted drafts/step" in capsys.readouterr().err


def test_bad_draft_specs_exit_2(checkpoint_dir, capsys):
    directory, _ = checkpoint_dir("qwen3_moe")
    for spec, message in [
        ("oracle:x", "oracle:A"),
        ("oracle:1.5", "in [0, 1]"),
        ("/nowhere", "neither a checkpoint directory"),
        ("auto:/nowhere", "neither a checkpoint directory"),
        ("autox", "neither a checkpoint directory"),
    ]:
        assert main(["generate", "--model", str(directory), "w1", "--draft", spec]) == 2
        assert message in capsys.readouterr().err
    assert (
        main(
            [
                "generate",
                "--model",
                str(directory),
                "w1",
                "--draft",
                "lookup",
                "--draft-length",
                "-1",
            ]
        )
        == 2
    )
    assert (
        main(
            [
                "generate",
                "--model",
                str(directory),
                "w1",
                "--draft",
                "oracle:0.5",
                "--temperature",
                "1",
            ]
        )
        == 2
    )


def test_json_reports_int8_experts_and_the_paths_they_run_on(checkpoint_dir, capsys):
    from moespec.kernels.cpu import cpu_paths

    directory, _ = checkpoint_dir("qwen3_moe")
    args = ["generate", "--model", str(directory), "w1 w2", "--max-tokens", "3", "--json"]
    assert main([*args, "--weights", "int8", "--draft", "none"]) == 0
    weights = json.loads(capsys.readouterr().out)["weights"]
    assert weights["experts"] == "int8" and weights["dense"] == "int8"
    # bf16 activations: the native int8 loops where they run, else PyTorch's kernel
    native = cpu_paths().native_int8 is not None
    path = "native-int8-pairs" if native else "aten-int8pack-mm"
    assert weights["expert_path"] == weights["dense_path"] == path
    assert weights["cpu"]["capability"] == cpu_paths().capability


def test_int8_experts_alone_and_bad_weight_formats(checkpoint_dir, capsys):
    from moespec.kernels.cpu import cpu_paths

    directory, _ = checkpoint_dir("qwen3_moe")
    args = ["generate", "--model", str(directory), "w1", "--max-tokens", "2"]
    assert main([*args, "--weights", "fp32"]) == 2
    assert "--weights fp32 disagrees with --dtype bf16" in capsys.readouterr().err
    assert main([*args, "--weights", "int8", "--offload", "lru"]) == 2
    assert "does not take --offload" in capsys.readouterr().err
    assert main([*args, "--weights", "int8-experts", "--json", "--draft", "none"]) == 0
    weights = json.loads(capsys.readouterr().out)["weights"]
    assert weights["experts"] == "int8" and weights["dense"] == "bf16"
    assert weights["dense_path"] == cpu_paths().bf16
    assert main([*args, "--weights", "int4"]) == 2
    assert "unknown weight format 'int4'" in capsys.readouterr().err
