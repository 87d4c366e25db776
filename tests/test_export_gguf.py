"""GGUF export: llama.cpp reads our files as the same model (logits, greedy tokens, tokens of
a text), and the file holds the checkpoint's tensors under llama.cpp's names."""

import shutil

import numpy as np
import pytest
import torch

from moespec.cli import main
from moespec.demo import demo_paths
from moespec.models import load_model
from tests.checkpoints import hf_model, save_checkpoint

gguf = pytest.importorskip("gguf", reason="the gguf package is absent (pip install '.[llamacpp]')")

from moespec.export.gguf import export_gguf  # noqa: E402

TEXT = 'def fib(n):\n    """Return 42 \u2014 the caf\u00e9\'s number."""\n\tif n <= 1:  return n\n'
# Tiny checkpoints of every family llama.cpp runs, with the demo pair's byte-level BPE (4,096
# tokens) and the settings llama.cpp's graph for the family implements.
TINY = {
    "qwen3_moe": dict(mlp_only_layers=[]),
    "olmoe": dict(clip_qkv=None, num_key_value_heads=4),
    "qwen3": {},
    "llama": {},
}


def tiny_checkpoint(directory, model_type, **overrides):
    settings = dict(vocab_size=4096, eos_token_id=0, bos_token_id=None, pad_token_id=0)
    model = hf_model(model_type, **{**settings, **TINY[model_type], **overrides})
    path = save_checkpoint(model, directory / model_type)
    shutil.copy(demo_paths()[0] / "tokenizer.json", path / "tokenizer.json")
    return path


def llama(path, **settings):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    # f32 keys and values: the default f16 cache would round them
    return llama_cpp.Llama(
        str(path), n_threads=1, n_ctx=256, type_k=0, type_v=0, verbose=False, **settings
    )


@pytest.mark.parametrize("model_type", list(TINY))
def test_llamacpp_logits_match_moespec_fp32_logits_at_every_position(tmp_path, model_type):
    path = tiny_checkpoint(tmp_path, model_type)
    export_gguf(path, tmp_path / "model.gguf", weight_type="f32")
    model, tokenizer = load_model(path, dtype="fp32")
    ids = tokenizer.encode(TEXT)
    ours = model(torch.tensor(ids), model.new_cache(), all_logits=True)[0].numpy()
    llm = llama(tmp_path / "model.gguf", logits_all=True)
    llm.eval(ids)
    theirs = np.asarray(llm.scores[: len(ids)])
    np.testing.assert_allclose(theirs, ours, atol=1e-4 * np.abs(ours).max(), rtol=0)


@pytest.mark.parametrize("which", [0, 1], ids=["target", "draft"])
def test_llamacpp_greedy_tokens_equal_moespec_greedy_tokens_on_the_demo_pair(tmp_path, which):
    from moespec.decoding import generate

    directory = demo_paths()[which]
    export_gguf(directory, tmp_path / "demo.gguf", weight_type="f32")
    model, tokenizer = load_model(directory, dtype="fp32")
    prompt = tokenizer.encode("def fibonacci(n):")
    ours = [t for step in generate(model, prompt, max_tokens=48) for t in step.tokens]
    llm = llama(tmp_path / "demo.gguf")
    theirs = []
    for token in llm.generate(prompt, temp=0.0):
        theirs.append(token)
        if len(theirs) == len(ours):
            break
    assert theirs == ours


def test_llamacpp_tokenizes_and_detokenizes_text_as_the_checkpoint_tokenizer(tmp_path):
    directory = demo_paths()[0]
    export_gguf(directory, tmp_path / "demo.gguf", weight_type="bf16")
    _, tokenizer = load_model(directory, dtype="bf16")
    llm = llama(tmp_path / "demo.gguf", vocab_only=True)
    text = TEXT + "<|endoftext|>  x = [1, 22, 333]\r\n    \u00fcber \U0001f600\n\n\n"
    ids = tokenizer.encode(text)
    assert llm.tokenize(text.encode(), add_bos=False, special=True) == ids
    assert llm.detokenize(ids, special=True).decode() == tokenizer.decode(ids)


def test_the_file_holds_every_expert_under_llamacpp_names_and_shapes(tmp_path):
    path = tiny_checkpoint(tmp_path, "olmoe")
    summary = export_gguf(path, tmp_path / "model.gguf", weight_type="f32")
    reader = gguf.GGUFReader(tmp_path / "model.gguf")
    tensors = {t.name: t for t in reader.tensors}
    assert summary["tensors"] == len(tensors)
    hf = hf_model("olmoe", vocab_size=4096, **TINY["olmoe"])  # the same seed: the same weights
    experts = hf.model.layers[1].mlp.experts
    gate_up = experts.gate_up_proj.detach().numpy()  # [E, 2I, H]
    inter = gate_up.shape[1] // 2
    stored = tensors["blk.1.ffn_up_exps.weight"]
    assert list(stored.shape) == [gate_up.shape[2], inter, gate_up.shape[0]]  # GGUF order
    np.testing.assert_array_equal(np.asarray(stored.data), gate_up[:, inter:])
    arch = reader.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "olmoe"


def test_q8_0_weights_are_within_half_a_quantization_step_of_the_originals(tmp_path):
    path = tiny_checkpoint(tmp_path, "qwen3_moe")
    export_gguf(path, tmp_path / "q8.gguf", weight_type="q8_0")
    reader = gguf.GGUFReader(tmp_path / "q8.gguf")
    stored = next(t for t in reader.tensors if t.name == "blk.0.ffn_down_exps.weight")
    assert stored.tensor_type == gguf.GGMLQuantizationType.Q8_0
    values = gguf.quants.dequantize(np.asarray(stored.data), stored.tensor_type)
    model = hf_model("qwen3_moe", vocab_size=4096, **TINY["qwen3_moe"])
    original = model.model.layers[0].mlp.experts.down_proj.detach().numpy()  # [E, H, I]
    blocks = original.reshape(-1, 32)
    step = np.abs(blocks).max(axis=1, keepdims=True) / 127
    error = np.abs(values.reshape(-1, 32) - blocks)
    # Half a step, plus the rounding of the step itself to f16 (2^-11 relative) times 127.
    assert (error <= step * (0.5 + 127 * 2**-11)).all()
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.ffn_gate_inp.weight"] == gguf.GGMLQuantizationType.F32  # router
    assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32


def test_a_setting_llamacpp_lacks_is_refused_with_one_line(tmp_path, capsys):
    path = tiny_checkpoint(tmp_path, "olmoe", clip_qkv=8.0)
    capsys.readouterr()
    assert main(["export-gguf", str(path), str(tmp_path / "x.gguf")]) == 2
    error = capsys.readouterr().err
    assert "clip_qkv" in error and error.count("\n") == 1
    assert not (tmp_path / "x.gguf").exists()


def test_a_word_level_tokenizer_is_refused_before_anything_is_written(tmp_path, capsys):
    path = save_checkpoint(hf_model("qwen3"), tmp_path / "words")  # a WordLevel tokenizer
    assert main(["export-gguf", str(path), str(tmp_path / "x.gguf")]) == 2
    assert "WordLevel" in capsys.readouterr().err
    assert list(tmp_path.glob("*.gguf")) == [] and list(tmp_path.glob(".x*")) == []


def test_an_existing_output_is_kept_without_force(tmp_path, capsys):
    out = tmp_path / "draft.gguf"
    out.write_text("keep")
    directory = str(demo_paths()[1])
    assert main(["export-gguf", directory, str(out), "--type", "q8_0"]) == 2
    assert out.read_text() == "keep" and "--force" in capsys.readouterr().err
    assert main(["export-gguf", directory, str(out), "--type", "q8_0", "--force"]) == 0
    assert gguf.GGUFReader(out).tensors
