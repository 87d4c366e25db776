"""`moespec plan --export`: a plan's k*(a) as vLLM's, SGLang's and llama.cpp's own settings,
the predicted saving beside them, and one-line refusals of plans of another clock."""

import argparse
import json
import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from moespec.cli import main
from moespec.costmodel import best_draft_length, expected_tokens, speedup
from moespec.errors import SettingError
from moespec.export.speculative import (
    LOOKUP_NGRAM,
    Timing,
    check_fits,
    decide,
    export_settings,
    mismatch,
    read_timing,
    step_times,
    timing_of_plan,
)
from moespec.plan import plan_from_dict

PLANS = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "plans"
DEMO = Path(__file__).resolve().parent.parent / "moespec" / "demo"
TAU = [1.0e-3, 1.1e-3, 1.2e-3, 1.3e-3, 1.45e-3, 1.6e-3, 1.8e-3, 2.0e-3, 2.3e-3]


def timing(draft_time=None, draft="demo/draft", acceptance=None, **facts) -> Timing:
    """A plan's timing with τ(n) = TAU and, unless None, a draft model's h(k)."""
    return Timing(
        engine="moespec",
        verify_time=TAU,
        draft_time=draft_time or [0.0] * len(TAU),
        draft=draft if draft_time else None,
        acceptance=acceptance,
        bandwidth_error=0.02,
        facts={"model": None, "weights": None, "engine": None, "machine": None, **facts},
    )


H = [0.0] + [0.25e-3 * k for k in range(1, len(TAU))]  # a draft model's h(k)


def committed(name: str) -> dict:
    return json.loads((PLANS / name / "plan.json").read_text())


# ------------------------------------------------------------------ the decision


def test_lookup_is_charged_no_draft_time_and_a_draft_model_its_h():
    t = timing(draft_time=H)
    assert step_times(t, "lookup") == TAU
    assert step_times(t, "model") == pytest.approx([v + h for v, h in zip(TAU, H, strict=True)])
    # the draft's cost makes shorter drafts best at the same acceptance
    assert decide(t, "model", 0.8).draft_length < decide(t, "lookup", 0.8).draft_length


@pytest.mark.parametrize("a", [0.2, 0.5, 0.8, 0.95])
def test_the_exported_draft_length_is_k_star_of_the_plans_step_times(a):
    decision = decide(timing(), "lookup", a)
    assert decision.draft_length == best_draft_length(TAU, a)


def test_the_predicted_saving_is_per_token_time_with_against_without_speculation():
    d = decide(timing(), "lookup", 0.8)
    k = d.draft_length
    assert d.plain_time == TAU[0]
    assert d.token_time == pytest.approx(TAU[k] / expected_tokens(0.8, k))
    assert d.speedup == pytest.approx(speedup(TAU, 0.8, k))
    assert d.saving == pytest.approx(1 - 1 / d.speedup)


def test_a_draft_models_measured_acceptance_is_the_default_but_lookup_needs_one_given():
    t = timing(draft_time=H, acceptance=0.9)
    assert decide(t, "model").acceptance == 0.9
    with pytest.raises(SettingError, match="no measured acceptance") as error:
        decide(t, "lookup")
    assert "--" not in str(error.value) and "acceptance" in str(error.value)


def test_a_plan_without_a_draft_model_cannot_export_one():
    with pytest.raises(SettingError, match="measured no draft model") as error:
        export_settings(timing(), "vllm", drafter="model", acceptance=0.8)
    assert "--" not in str(error.value)


def test_the_command_offers_the_targets_and_drafters_the_library_exports():
    from moespec.cli import plan as command
    from moespec.export import speculative

    assert command.TARGETS == speculative.TARGETS and command.DRAFTERS == speculative.DRAFTERS


def test_an_unknown_target_is_refused_by_the_library_too():
    with pytest.raises(SettingError, match="unknown export target 'tgi'"):
        export_settings(timing(), "tgi", acceptance=0.8)


# ------------------------------------------------------------------ engine settings


def test_vllm_gets_an_ngram_config_with_moespecs_lookup_bounds():
    doc = export_settings(timing(), "vllm", acceptance=0.8)
    k = best_draft_length(TAU, 0.8)
    assert doc["speculative_config"] == {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": LOOKUP_NGRAM[0],
        "prompt_lookup_max": LOOKUP_NGRAM[1],
    }
    assert doc["predicted"]["draft_length"] == k and doc["predicted"]["timed_by"] == "moespec"


def test_vllm_gets_the_draft_checkpoint_and_none_when_plain_is_fastest():
    doc = export_settings(timing(draft_time=H), "vllm", acceptance=0.8, draft="org/draft")
    config = doc["speculative_config"]
    assert config["method"] == "draft_model" and config["model"] == "org/draft"
    k = decide(timing(draft_time=H), "model", 0.8).draft_length
    assert config["num_speculative_tokens"] == k
    plain = export_settings(timing(), "vllm", acceptance=0.0)
    assert plain["speculative_config"] is None and not plain["predicted"]["speculate"]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_sglang_verifies_k_plus_one_tokens_in_one_chain():
    k = best_draft_length(TAU, 0.8)
    lookup = export_settings(timing(), "sglang", acceptance=0.8)["args"]
    assert flag(lookup, "--speculative-algorithm") == "NGRAM"
    assert flag(lookup, "--speculative-num-draft-tokens") == str(k + 1)
    assert flag(lookup, "--speculative-ngram-max-bfs-breadth") == "1"
    model = export_settings(timing(draft_time=H), "sglang", acceptance=0.8, draft="d")["args"]
    k = decide(timing(draft_time=H), "model", 0.8).draft_length
    assert flag(model, "--speculative-algorithm") == "STANDALONE"
    assert flag(model, "--speculative-draft-model-path") == "d"
    assert flag(model, "--speculative-num-steps") == str(k)
    assert flag(model, "--speculative-eagle-topk") == "1"
    assert flag(model, "--speculative-num-draft-tokens") == str(k + 1)


def test_llamacpp_drafts_exactly_k_tokens_from_a_gguf_in_new_and_older_flag_names():
    t = timing(draft_time=H, draft="d.gguf")
    doc = export_settings(t, "llamacpp", acceptance=0.8)
    k = str(decide(t, "model", 0.8).draft_length)
    args, older = doc["args"], doc["older_builds"]
    assert flag(args, "--spec-draft-model") == "d.gguf" and flag(older, "-md") == "d.gguf"
    assert flag(args, "--spec-draft-n-max") == k and flag(args, "--spec-draft-n-min") == k
    assert flag(older, "--draft-max") == k and flag(older, "--draft-min") == k
    assert flag(args, "--spec-draft-p-min") == "0" and flag(older, "--draft-p-min") == "0"


def test_each_engine_is_refused_a_draft_in_the_other_engines_format():
    t = timing(draft_time=H, draft="moespec/demo/draft")
    with pytest.raises(SettingError, match="llama.cpp loads a GGUF draft"):
        export_settings(t, "llamacpp", acceptance=0.8)
    with pytest.raises(SettingError, match="vllm loads the draft's checkpoint"):
        export_settings(t, "vllm", acceptance=0.8, draft="d.gguf")
    with pytest.raises(SettingError, match="not moespec's prompt lookup"):
        export_settings(timing(), "llamacpp", acceptance=0.8)


# ------------------------------------------------------------------ plans of another clock


def test_a_plan_of_another_machine_engine_model_or_weights_is_refused_naming_which():
    machine = {"cpu": "AMD EPYC", "cores": 2}
    t = timing(
        model={"num_experts": 64, "top_k": 8},
        weights="bf16",
        engine={"moespec": "0.1.0", "torch": "2.13.0+cpu"},
        machine=machine,
    )
    same = {
        "model": {"num_experts": 64, "top_k": 8, "num_layers": 4},
        "weights": "bf16",
        "engine": {"moespec": "0.1.0", "torch": "2.13.0+cpu"},
        "machine": machine,
    }
    assert mismatch(t.facts, same) is None
    for change, words in [
        ({"model": {"num_experts": 16, "top_k": 8}}, "another model: num_experts is 64"),
        ({"weights": "int8"}, "another weights kind: 'bf16' there and 'int8' here"),
        ({"engine": {"moespec": "0.2.0", "torch": "2.13.0+cpu"}}, "another engine: moespec"),
        ({"machine": {"cpu": "Xeon", "cores": 2}}, "another machine: 'AMD EPYC'"),
    ]:
        with pytest.raises(ValueError, match=words) as error:
            check_fits(t, {**same, **change})
        assert "\n" not in str(error.value)
    # what is not known here (no model given, no engine installed) is not compared
    assert mismatch(t.facts, {"machine": machine, "engine": None}) is None


def test_a_committed_plan_reads_with_its_recorded_facts():
    plan = plan_from_dict(committed("olmoe4L-bf16"))
    t = timing_of_plan(plan)
    assert t.verify_time == plan.verify_time and t.draft is None  # it measured no draft
    assert t.facts["weights"] == "bf16" and t.facts["machine"]["cores"] == 2
    assert t.facts["engine"]["moespec"] == plan.provenance.versions["moespec"]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda p: p.update(verify_time="fast"), "verify_time must be a list"),
        (lambda p: p["kernel"].update(crossover="3"), "kernel.crossover must be of type int"),
        (lambda p: p.update(colour="blue"), "unknown key 'colour'"),
    ],
)
def test_a_hand_edited_moespec_plan_is_refused_naming_the_field(tmp_path, change, message):
    data = plan_from_dict(committed("demo-bf16")).to_dict()
    change(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message) as error:
        read_timing(path)
    assert "\n" not in str(error.value) and str(path) in str(error.value)


def llamacpp_plan(**changes) -> dict:
    plan = {
        "format": "moespec-plan",
        "engine": "llamacpp",
        "draft_gguf": "d.gguf",
        "model": {"architecture": "olmoe", "num_experts": 64, "top_k": 8},
        "versions": {"llama_cpp_python": "0.3.36", "llama_cpp": "x"},
        "bandwidth_error": 0.05,
        "verify_time": TAU,
        "draft_time": H,
        "measured_acceptance": 0.7,
    }
    return {**plan, **changes}


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"verify_time": [1e-3, -1.0]}, "verify_time must be a non-empty list"),
        ({"draft_time": H[:3]}, "draft_time must hold one time per verify_time"),
        ({"measured_acceptance": 1.5}, "measured_acceptance must be a number in"),
        ({"bandwidth_error": None}, "bandwidth_error must be a number"),
        ({"engine": "vllm"}, "engine must be 'llamacpp'"),
    ],
)
def test_a_hand_edited_llamacpp_plan_is_refused_naming_the_field(tmp_path, changes, message):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(llamacpp_plan(**changes)))
    with pytest.raises(ValueError, match=message):
        read_timing(path)


def test_a_llamacpp_plan_exports_at_its_measured_acceptance(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(llamacpp_plan()))
    t = read_timing(path)
    doc = export_settings(t, "llamacpp")
    steps = [v + h for v, h in zip(TAU, H, strict=True)]
    assert doc["predicted"]["acceptance"] == 0.7 and doc["predicted"]["timed_by"] == "llamacpp"
    assert doc["predicted"]["draft_length"] == best_draft_length(steps, 0.7)


# ------------------------------------------------------------------ the command


@pytest.fixture
def demo_plan(tmp_path) -> Path:
    """The committed demo plan (format /1: it records no machine, so it is of any)."""
    path = tmp_path / "plan.json"
    shutil.copy(PLANS / "demo-bf16" / "plan.json", path)
    return path


def test_the_command_writes_the_settings_beside_the_plan_and_keeps_them_without_force(
    demo_plan, capsys
):
    argv = ["plan", "--export", "vllm", "--plan", str(demo_plan), "--acceptance", "0.8"]
    assert main(argv) == 0
    out = demo_plan.parent / "vllm.json"
    written = json.loads(out.read_text())
    assert written["speculative_config"]["method"] == "ngram"
    assert "--speculative-config" in capsys.readouterr().out
    out.write_text("{}")
    assert main(argv) == 2  # kept
    assert out.read_text() == "{}" and "--force" in capsys.readouterr().err
    assert main([*argv, "--force"]) == 0 and json.loads(out.read_text()) == written
    assert not list(demo_plan.parent.glob(".vllm.json.*"))  # no temporary left behind


def test_the_command_refuses_an_unknown_target_and_a_missing_acceptance_in_one_line(
    demo_plan, capsys
):
    assert main(["plan", "--export", "tgi", "--plan", str(demo_plan)]) == 2
    assert "invalid choice: 'tgi'" in capsys.readouterr().err
    assert main(["plan", "--export", "sglang", "--plan", str(demo_plan)]) == 2
    err = capsys.readouterr().err
    assert "give --acceptance" in err and err.count("\n") == 1


def test_the_command_refuses_a_plan_of_another_model(demo_plan, tmp_path, capsys):
    from moespec.demo import demo_paths

    target, _ = demo_paths()
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((target / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_local_experts": 32}))
    argv = ["plan", "--export", "vllm", "--plan", str(demo_plan), "--acceptance", "0.8"]
    assert main([*argv, "--model", str(target)]) == 0
    assert main([*argv, "--model", str(other), "--force"]) == 2
    assert "another model: num_experts is 16 there and 32 here" in capsys.readouterr().err


def test_the_command_refuses_a_plan_of_another_machine(tmp_path, capsys):
    data = plan_from_dict(committed("demo-bf16"))
    machine = {"platform": "x", "cpu": "a CPU of elsewhere", "cpu_count": 999, "python": "3"}
    plan = replace(data, provenance=replace(data.provenance, machine=machine))
    path = plan.save(tmp_path / "plan.json")
    assert main(["plan", "--export", "vllm", "--plan", str(path), "--acceptance", "0.8"]) == 2
    assert "another machine: 'a CPU of elsewhere' with 999 cores" in capsys.readouterr().err
    assert not (tmp_path / "vllm.json").exists()


# ------------------------------------------------------------------ the engines' own parsers


def test_vllms_own_speculative_config_accepts_the_export():
    """Built by vLLM's SpeculativeConfig (its validators run): the n-gram config alone, the
    draft model's with the demo target's and draft's model configs (vLLM reads them)."""
    vllm_config = pytest.importorskip("vllm.config", reason="vLLM is not installed here")
    lookup = export_settings(timing(), "vllm", acceptance=0.8)["speculative_config"]
    built = vllm_config.SpeculativeConfig(**lookup)
    assert built.method == "ngram"
    assert built.num_speculative_tokens == lookup["num_speculative_tokens"]
    assert (built.prompt_lookup_min, built.prompt_lookup_max) == LOOKUP_NGRAM
    draft = str(DEMO / "draft")
    model = export_settings(timing(draft_time=H), "vllm", acceptance=0.8, draft=draft)
    target = vllm_config.ModelConfig(model=str(DEMO / "target"), tokenizer=str(DEMO / "target"))
    built = vllm_config.SpeculativeConfig(
        **model["speculative_config"],
        target_model_config=target,
        target_parallel_config=vllm_config.ParallelConfig(),
    )
    assert built.method == "draft_model" and built.draft_model_config.model == draft
    assert built.num_speculative_tokens == model["speculative_config"]["num_speculative_tokens"]


def test_sglangs_own_argument_parser_accepts_the_export():
    """Parsed by SGLang's server argument parser into its ServerArgs (its later resolution,
    which loads the model's configs, is not run)."""
    server_args = pytest.importorskip("sglang.srt.server_args", reason="SGLang is not installed")
    parser = argparse.ArgumentParser()
    server_args.ServerArgs.add_cli_args(parser)
    for doc in (
        export_settings(timing(), "sglang", acceptance=0.8),
        export_settings(timing(draft_time=H), "sglang", acceptance=0.8, draft=str(DEMO / "draft")),
    ):
        argv = ["--model-path", str(DEMO / "target"), "--device", "cpu", *doc["args"]]
        parsed = server_args.ServerArgs.from_cli_args(parser.parse_args(argv))
        assert parsed.speculative_num_draft_tokens == doc["predicted"]["draft_length"] + 1
        assert parsed.speculative_algorithm == flag(doc["args"], "--speculative-algorithm")


def test_llama_servers_own_argument_parser_accepts_the_export(tmp_path):
    """llama-server ($LLAMA_SERVER, else on the PATH) parses the flags and goes on to load the
    models (absent here: it stops there); an unknown or removed flag stops it while parsing."""
    server = os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    if server is None:
        pytest.skip("no llama-server here ($LLAMA_SERVER or on the PATH)")
    draft = tmp_path / "draft.gguf"
    doc = export_settings(timing(draft_time=H, draft=str(draft)), "llamacpp", acceptance=0.8)
    assert doc["predicted"]["speculate"]

    def run(args: list[str]) -> str:
        argv = [server, "-m", str(tmp_path / "target.gguf"), "--port", "0", *args]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        return done.stdout + done.stderr

    printed = run(doc["args"])
    refusals = ("invalid argument", "error while handling argument")  # llama.cpp's words
    assert not any(words in printed.lower() for words in refusals), printed
    assert str(draft) in printed and "failed to load model" in printed  # parsed, then loaded
    assert "invalid argument: --spec-draft-n-maxx" in run(["--spec-draft-n-maxx", "3"])
