"""The captured (compiled) one-token decode step: eager's greedy tokens, and eager when it
cannot run."""

import pytest
import torch

from moespec.decoding import Sampler, generate
from moespec.decoding.draft_policy import DraftLengthPolicy
from moespec.decoding.drafters import ModelDrafter
from moespec.models import compiled, load_model
from moespec.models.compiled import capture, compile_report

PROMPT = [5, 6, 7]


def greedy(model, max_tokens=24, drafter=None):
    policy = DraftLengthPolicy(4) if drafter else None  # k > 1: the draft steps its model
    records = generate(model, PROMPT, max_tokens=max_tokens, drafter=drafter, draft_policy=policy)
    return [t for r in records for t in r.tokens]


@pytest.fixture
def model(checkpoint_dir):
    # qwen3_moe's tiny checkpoint has MoE layers and a dense one (mlp_only_layers)
    directory, _ = checkpoint_dir("qwen3_moe")
    return load_model(directory, dtype="fp32")[0]


def test_captured_step_gives_eager_greedy_tokens_in_fp32_and_drafts_for_speculation(
    model, checkpoint_dir
):
    if reason := compiled.compiler_missing():
        pytest.skip(reason)
    eager = greedy(model)
    report = capture(model, "auto")
    assert report == {"mode": "auto", "captured": True, "note": None}
    assert greedy(model) == eager
    assert model.captured_step.steps >= len(eager) - 1
    # As its own draft, compiled: speculation still gives the plain greedy tokens.
    target = load_model(checkpoint_dir("qwen3_moe")[0], dtype="fp32")[0]
    drafter = ModelDrafter(model, Sampler(), model.config.vocab_size)
    steps = model.captured_step.steps
    assert greedy(target, drafter=drafter) == eager
    assert model.captured_step.steps > steps
    assert compile_report(model)["captured"]


def test_without_a_compiler_the_step_stays_eager_and_says_why(model, monkeypatch):
    eager = greedy(model, 8)
    monkeypatch.setattr(compiled, "compiler_missing", lambda: "no C++ compiler found (g++)")
    report = capture(model, "on")
    assert report["captured"] is False and model.captured_step is None
    assert report["note"] == "decoding eagerly: no C++ compiler found (g++)"
    assert greedy(model, 8) == eager


def test_a_failed_compile_decodes_eagerly_and_reports_the_failure(model, monkeypatch):
    eager = greedy(model, 8)

    def broken(function, **_):
        def run(*args):
            raise RuntimeError("C++ compile error: cc1plus missing\nmore detail")

        return run

    monkeypatch.setattr(compiled, "compiler_missing", lambda: None)
    monkeypatch.setattr(torch, "compile", broken)
    assert capture(model, "on")["captured"] is True  # compiling happens at the first step
    assert greedy(model, 8) == eager
    report = compile_report(model)
    assert report["captured"] is False
    assert (
        report["note"] == "decoding eagerly: the compile failed: C++ compile error: cc1plus missing"
    )


def test_auto_keeps_a_model_with_a_product_worth_two_threads_eager(model, monkeypatch):
    monkeypatch.setattr(compiled, "compiler_missing", lambda: None)
    monkeypatch.setattr(compiled, "SMALL_WORK_BYTES", 1024)
    report = capture(model, "auto")
    assert report["captured"] is False and "more than one thread" in report["note"]
    assert capture(model, "off") == {"mode": "off", "captured": False, "note": "off"}
    model.batch_invariant = True
    report = capture(model, "on")
    assert report["captured"] is False and "batch-invariant" in report["note"]


class CountingStep:
    def __init__(self):
        self.calls = 0

    def __call__(self, token, cache):
        self.calls += 1
        return None  # as a failed compile does: the pass runs eagerly


def test_batch_invariant_passes_never_take_the_captured_step(model):
    model.captured_step = CountingStep()
    model.batch_invariant = True
    greedy(model, 6)
    assert model.captured_step.calls == 0
    model.batch_invariant = False
    greedy(model, 6)
    assert model.captured_step.calls == 5  # the decode steps, not the prompt's pass


def test_unknown_compile_mode_is_refused(model):
    with pytest.raises(ValueError, match="compile mode must be one of auto, on, off"):
        capture(model, "fast")


def test_a_lowered_dispatch_decodes_eagerly_and_says_why(monkeypatch):
    from moespec.kernels import isa

    if compiled.compiler_missing():
        pytest.skip(compiled.compiler_missing())
    flags = ("avx2", "fma", "avx512f")
    monkeypatch.setattr(isa, "this_cpu", lambda: ("AVX2", flags, "avx2"))
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert compiled.compiler_missing() == (
        "ATEN_CPU_CAPABILITY=avx2 lowers the dispatch, where the step miscompiles"
    )
    monkeypatch.setattr(isa, "this_cpu", lambda: ("AVX512", flags, "avx512"))
    assert compiled.compiler_missing() is None
