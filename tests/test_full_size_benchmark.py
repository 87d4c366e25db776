"""Random checkpoints of full-size shapes written tensor by tensor
(moespec.bench.checkpoints.streamed_random_checkpoint), checked on tiny shapes."""

import json

import pytest
import torch

from moespec.bench.checkpoints import (
    FULL_SIZE,
    SHAPES,
    checkpoint_tensors,
    streamed_random_checkpoint,
)

TINY = {
    "olmoe": {
        "name": "tiny-olmoe",
        "model_type": "olmoe",
        "hidden_size": 64,
        "intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 4096,
        "eos_token_id": None,
        "num_hidden_layers": 4,
    },
    "qwen3_moe": {
        "name": "tiny-qwen3",
        "model_type": "qwen3_moe",
        "hidden_size": 64,
        "moe_intermediate_size": 32,
        "intermediate_size": 96,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 24,  # norms of 48 bytes: tensors that do not start aligned
        "vocab_size": 4096,
        "tie_word_embeddings": False,
        "num_hidden_layers": 4,
    },
}


@pytest.mark.parametrize("family", sorted(TINY))
def test_streamed_checkpoint_loads_as_transformers_writes_it(family, tmp_path):
    import transformers

    from moespec.models import load_model

    directory = streamed_random_checkpoint(TINY[family], tmp_path, layers=2)
    assert directory.name == f"{TINY[family]['name']}-2L-streamed"
    assert not list(tmp_path.glob(".*.tmp"))
    config = json.loads((directory / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["model_type"] == family

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.bfloat16, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"] and not info["error_msgs"]
    # the same names and shapes as transformers' own model of that config
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(hf.config)
    expected = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in hf.state_dict().items()} == expected
    # and the layout save_pretrained writes
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert list(index["weight_map"]) == [n for n, _, _ in checkpoint_tensors(hf.config)]
    state = hf.state_dict()
    assert torch.equal(state["model.norm.weight"], torch.ones_like(state["model.norm.weight"]))
    embed = state["model.embed_tokens.weight"].float()
    assert 0.015 < embed.std().item() < 0.025
    router = state["model.layers.0.mlp.gate.weight"].float()
    assert router.abs().sum() > 0

    # moespec reads the same weights: its logits are transformers' (fp32 both)
    model, tokenizer = load_model(directory, dtype="fp32")
    assert len(model.layers) == 2
    tokens = torch.tensor([tokenizer.encode("def fibonacci(n):")])
    hf = hf.float()
    with torch.no_grad():
        theirs = hf(tokens).logits.float()
    ours = model(tokens, model.new_cache(), all_logits=True)
    assert ours.shape == theirs.shape and theirs.shape[-1] == 4096
    assert (ours - theirs).abs().max() <= 1e-4


def test_streamed_checkpoint_is_reused_and_deterministic(tmp_path):
    first = streamed_random_checkpoint(TINY["olmoe"], tmp_path / "a", layers=1)
    stamp = (first / "config.json").stat().st_mtime_ns
    assert streamed_random_checkpoint(TINY["olmoe"], tmp_path / "a", layers=1) == first
    assert (first / "config.json").stat().st_mtime_ns == stamp
    second = streamed_random_checkpoint(TINY["olmoe"], tmp_path / "b", layers=1)
    for path in first.glob("*.safetensors"):
        assert path.read_bytes() == (second / path.name).read_bytes()


def test_shards_split_at_the_limit(tmp_path, monkeypatch):
    from moespec.bench import checkpoints

    monkeypatch.setattr(checkpoints, "SHARD_BYTES", 200_000)
    monkeypatch.setattr(checkpoints, "CHUNK_BYTES", 4096)  # tensors written in several chunks
    directory = streamed_random_checkpoint(TINY["olmoe"], tmp_path, layers=2)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    data = sum((directory / f).stat().st_size for f in files)
    assert (
        index["metadata"]["total_size"] < data < index["metadata"]["total_size"] + 8192 * len(files)
    )


@pytest.mark.parametrize("name", FULL_SIZE)
def test_full_size_shapes_count_their_parameters(name):
    """olmoe-1b-7b: 6.9B parameters (1.3B active); qwen3-30b-a3b: 30.5B (3.3B active)."""
    from moespec.bench.checkpoints import _config

    config = _config(SHAPES[name])
    total = sum(s[0] * (s[1] if len(s) > 1 else 1) for _, _, s in checkpoint_tensors(config))
    assert {"olmoe-1b-7b": 6.9e9, "qwen3-30b-a3b": 30.5e9}[name] == pytest.approx(total, rel=0.02)
