"""Qwen3.5-MoE: what its tiny checkpoint exercises (gated attention, the gated shared
expert), the limits of its recurrent state's rollback, and the multimodal layout.
(Logits and generation parity run in test_models_parity.py.)"""

import json
import shutil

import pytest
import torch

from moespec.models import CheckpointError, load_model

pytest.importorskip("transformers")

TOKENS = torch.tensor([[5, 17, 33, 2, 90, 41, 7, 12, 60, 3, 3, 3, 44, 17, 5]])


def logits_of(model):
    return model(TOKENS, model.new_cache(), all_logits=True)


def without_output_gate(model):
    for layer in model.layers:
        if hasattr(layer.attention, "output_gate"):
            layer.attention.output_gate = None


def without_shared_expert(model):
    for block in model.moe_blocks.values():
        block.shared_gate = torch.full_like(block.shared_gate, 0.0)
        block.shared.down = torch.zeros_like(block.shared.down)


@pytest.mark.parametrize("change", [without_output_gate, without_shared_expert])
def test_the_checkpoint_exercises_gated_attention_and_the_shared_expert(checkpoint_dir, change):
    model, _ = load_model(checkpoint_dir("qwen3_5_moe_text")[0], dtype="fp32", pack=False)
    before = logits_of(model)
    change(model)
    assert (logits_of(model) - before).abs().max() > 1e-2


def test_the_recurrent_state_rolls_back_within_the_last_pass_only(checkpoint_dir):
    model, _ = load_model(checkpoint_dir("qwen3_5_moe_text")[0], dtype="fp32")
    cache = model.new_cache()
    model(TOKENS[:, :6], cache)
    model(TOKENS[:, 6:9], cache)
    cache.rollback(5)  # before the last pass began
    with pytest.raises(
        ValueError, match=r"cannot return to position 5: .*\(positions \[6, 7, 8, 9\]\)"
    ):
        model(TOKENS[:, 5:6], cache)


def test_a_missing_linear_attention_tensor_names_file_and_tensor(checkpoint_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    directory = tmp_path / "bad"
    shutil.copytree(checkpoint_dir("qwen3_5_moe_text")[0], directory)
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.linear_attn.A_log"]
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.linear_attn\.A_log' is missing"):
        load_model(directory)


def test_the_language_model_of_a_multimodal_checkpoint_loads_like_the_text_model(
    checkpoint_dir, tmp_path
):
    # As the released Qwen3.5-MoE checkpoints hold it: model.language_model.*, text_config.
    from safetensors.torch import load_file, save_file

    text_dir, hf = checkpoint_dir("qwen3_5_moe_text")
    directory = tmp_path / "multimodal"
    shutil.copytree(text_dir, directory)
    tensors = load_file(directory / "model.safetensors")
    renamed = {
        name.replace("model.", "model.language_model.", 1)
        if name.startswith("model.")
        else name: tensor
        for name, tensor in tensors.items()
    }
    save_file(renamed, directory / "model.safetensors")
    text = json.loads((directory / "config.json").read_text())
    config = {"model_type": "qwen3_5_moe", "text_config": text}
    (directory / "config.json").write_text(json.dumps(config))
    model, _ = load_model(directory, dtype="fp32")
    with torch.no_grad():
        expected = hf(TOKENS).logits
    assert (logits_of(model) - expected).abs().max() <= 1e-4
