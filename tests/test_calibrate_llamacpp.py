"""llama.cpp as a measured engine: a pass after a rollback sees exactly the kept cache, greedy
decoding equals moespec's, and the measurements come in moespec's record format."""

import numpy as np
import pytest

pytest.importorskip("gguf", reason="the gguf package is absent (pip install '.[llamacpp]')")
pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

from moespec.calibrate.llamacpp import LlamaCpp, measure_draft_time, measure_verify  # noqa: E402
from moespec.demo import demo_paths  # noqa: E402
from moespec.export.gguf import export_gguf  # noqa: E402
from moespec.models import load_model  # noqa: E402


@pytest.fixture(scope="module")
def draft_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "draft-f32.gguf"
    export_gguf(demo_paths()[1], path, weight_type="f32")
    return path


@pytest.fixture(scope="module")
def text_tokens():
    _, tokenizer = load_model(demo_paths()[1], dtype="fp32")
    return tokenizer.encode("import os\nimport sys\n\n\ndef main(argv=None):\n" * 8)


def test_a_pass_after_a_rollback_sees_only_the_kept_positions(draft_gguf, text_tokens):
    engine = LlamaCpp(draft_gguf, exact_cache=True)
    engine.prefill(text_tokens[:20])
    first = engine.forward(text_tokens[20:25])
    engine.rollback(20)
    engine.forward(text_tokens[30:36])  # a rejected draft of another length
    engine.rollback(20)
    assert engine.length == 20
    np.testing.assert_array_equal(engine.forward(text_tokens[20:25]), first)
    assert first.shape == (5, engine.vocab_size)


def test_greedy_decoding_equals_moespec_greedy_decoding_in_fp32(draft_gguf):
    from moespec.decoding import generate

    model, tokenizer = load_model(demo_paths()[1], dtype="fp32")
    prompt = tokenizer.encode("def fibonacci(n):")
    ours = [t for step in generate(model, prompt, max_tokens=40) for t in step.tokens]
    assert LlamaCpp(draft_gguf, exact_cache=True).greedy(prompt, 40) == ours


def test_more_threads_give_the_same_tokens(draft_gguf, text_tokens):
    engine = LlamaCpp(draft_gguf, exact_cache=True)
    one = engine.greedy(text_tokens[:10], 12)
    engine.threads = 2
    assert engine.threads == 2 and engine.greedy(text_tokens[:10], 12) == one


def test_verify_and_draft_times_come_in_moespecs_record_format(draft_gguf, text_tokens):
    engine = LlamaCpp(draft_gguf)
    records = measure_verify(engine, text_tokens, depth=16, pass_sizes=(1, 2, 3), repeats=2)
    assert [r["n_tokens"] for r in records] == [1, 2, 3]
    assert all(len(r["seconds"]) == 2 and r["median"] > 0 and r["depth"] == 16 for r in records)
    assert engine.length == 16  # every pass removed again
    draft = measure_draft_time(engine, text_tokens, depth=16, max_draft_length=3, repeats=2)
    assert len(draft) == 4 and draft[0] == 0.0 and all(h > 0 for h in draft[1:])


def test_a_missing_file_is_one_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        LlamaCpp(tmp_path / "absent.gguf")
