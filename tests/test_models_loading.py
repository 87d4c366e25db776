"""Loading checkpoints: every failure names the file and the tensor; nothing half-loaded."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moespec.models import CheckpointError, load_config, load_model
from tests.checkpoints import edit_config


@pytest.fixture
def checkpoint(checkpoint_dir, tmp_path):
    """A private copy of the tiny Qwen3-MoE checkpoint, free to damage."""
    source, _ = checkpoint_dir("qwen3_moe")
    target = tmp_path / "ckpt"
    shutil.copytree(source, target)
    return target


def rewrite_tensors(directory, change):
    path = directory / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)
    return path


def test_config_fields_come_from_config_json(checkpoint):
    config = load_config(checkpoint)
    assert config.model_type == "qwen3_moe"
    assert (config.num_experts, config.top_k, config.num_layers) == (8, 2, 3)
    assert config.moe_layers == (True, False, True)  # mlp_only_layers=[1]


def test_unsupported_model_type(checkpoint):
    edit_config(checkpoint, model_type="gpt2")
    with pytest.raises(CheckpointError, match=r"config.json: model_type 'gpt2' is not supported"):
        load_model(checkpoint)


def test_missing_config_key_is_named(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    del config["num_experts_per_tok"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="num_experts_per_tok"):
        load_model(checkpoint)


def test_missing_tensor_is_named(checkpoint):
    rewrite_tensors(checkpoint, lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"'model.layers.2.mlp.experts.5.up_proj.weight'"):
        load_model(checkpoint)


def test_misshapen_tensor_names_file_tensor_and_shapes(checkpoint):
    name = "model.layers.0.self_attn.k_proj.weight"

    def change(tensors):
        tensors[name] = tensors[name][:-1].clone()

    path = rewrite_tensors(checkpoint, change)
    with pytest.raises(CheckpointError) as error:
        load_model(checkpoint)
    assert str(path) in str(error.value) and name in str(error.value)
    assert "shape [31, 64], expected [32, 64]" in str(error.value)


def test_integer_tensor_is_a_bad_dtype(checkpoint):
    name = "model.norm.weight"

    def change(tensors):
        tensors[name] = tensors[name].to(torch.int32)

    rewrite_tensors(checkpoint, change)
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' has dtype torch.int32"):
        load_model(checkpoint)


def test_truncated_safetensors_is_refused(checkpoint):
    path = checkpoint / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(checkpoint)


def test_garbage_safetensors_is_refused(checkpoint):
    (checkpoint / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_model(checkpoint)


def test_missing_directory_and_files(tmp_path, checkpoint):
    with pytest.raises(CheckpointError, match="is not a checkpoint directory"):
        load_model(tmp_path / "nowhere")
    (checkpoint / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json does not exist"):
        load_model(checkpoint)


def test_invalid_json_is_refused(checkpoint):
    (checkpoint / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        load_model(checkpoint)


def test_index_pointing_at_missing_shard(checkpoint):
    (checkpoint / "model.safetensors").rename(checkpoint / "model-00001-of-00001.safetensors")
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="listed in model.safetensors.index.json"):
        load_model(checkpoint)


def test_generation_config_adds_stop_tokens(checkpoint):
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert set(load_config(checkpoint).eos_token_ids) >= {7, 9}


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_unsupported_rope_scaling_is_refused(checkpoint, kind):
    edit_config(checkpoint, rope_scaling={"rope_type": kind, "factor": 4.0})
    with pytest.raises(CheckpointError, match=f"rope scaling type '{kind}' is not supported"):
        load_model(checkpoint)


def test_yarn_scaling_without_its_original_context_is_refused(checkpoint):
    edit_config(checkpoint, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(CheckpointError, match="config.json: rope scaling 'yarn' needs"):
        load_model(checkpoint)
