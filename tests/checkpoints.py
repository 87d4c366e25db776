"""Tiny random checkpoints written by `transformers`' own save_pretrained, for every family."""

import json
from pathlib import Path

import pytest

ATTENTION = {
    "vocab_size": 96,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}

FAMILIES = {
    "qwen3_moe": dict(
        ATTENTION,
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        decoder_sparse_step=1,
        tie_word_embeddings=False,
    ),
    "olmoe": dict(
        ATTENTION,
        intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        clip_qkv=8.0,
    ),
    "mixtral": dict(
        ATTENTION,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=None,
    ),
    "qwen3": dict(ATTENTION, head_dim=16, intermediate_size=96, tie_word_embeddings=True),
    "llama": dict(
        ATTENTION,
        intermediate_size=96,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # DeepSeek-V2 (not Lite): q through its own latent, group-limited routing, a scaling
    # factor, yarn with mscale != mscale_all_dim (cos/sin and the softmax both scaled).
    "deepseek_v2": dict(
        ATTENTION,
        num_key_value_heads=4,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=2,
        first_k_dense_replace=1,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.0,
        attention_bias=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 64,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
        },
    ),
    # GLM-4.5 with two groups of experts (the real ones have one) and per-head q/k norms.
    "glm4_moe": dict(
        ATTENTION,
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        use_qk_norm=True,
        attention_bias=True,
    ),
    # gpt-oss: a window shorter than the tests' sequences, weights large enough (0.05) that
    # the clamp of its SwiGLU (limit 0.5) bites, YaRN as released (factor 32 over 4096).
    "gpt_oss": dict(
        ATTENTION,
        head_dim=16,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=4,
        swiglu_limit=0.5,
        initializer_range=0.05,
        max_position_embeddings=131072,
    ),
    # MiniMax-M2: rope on half of each head, as released (rotary_dim 64 of head_dim 128).
    "minimax_m2": dict(
        ATTENTION,
        head_dim=16,
        rotary_dim=8,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        bos_token_id=None,
        eos_token_id=None,
    ),
    # Qwen3.5-MoE: three Gated DeltaNet layers, then gated full attention.
    "qwen3_5_moe_text": dict(
        ATTENTION,
        num_hidden_layers=4,
        head_dim=16,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    ),
}

MOE_FAMILIES = ["qwen3_moe", "olmoe", "mixtral", "qwen3_5_moe_text"]
# Tensors that transformers initialises to zero (or near it) in these families: random in the
# tests, so that the checkpoints exercise them (biases, sinks, score corrections).
# {family: (standard deviation, name endings)}
RANDOMISED = {
    "glm4_moe": (0.2, ("e_score_correction_bias",)),  # a choice bias that changes choices
    "gpt_oss": (0.5, ("sinks", "router.bias", "gate_up_proj_bias", "down_proj_bias")),
    "minimax_m2": (0.5, ("e_score_correction_bias",)),
    "qwen3_5_moe_text": (0.5, ("norm.weight",)),  # zero-centred norms start at zero
}


def hf_model(model_type: str, seed: int = 0, **overrides):
    """A random `transformers` model of the family, in float32 and eval mode."""
    transformers = pytest.importorskip("transformers")
    import torch

    config = transformers.AutoConfig.for_model(model_type, **{**FAMILIES[model_type], **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # routers start at zero in some families: give them real logits
        for name, param in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")) and param.dim() == 2:
                param.normal_(0, 0.5)
        std, names = RANDOMISED.get(model_type, (0.0, ()))
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(names):
                tensor.normal_(0, std)
    return model.eval()


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer.json over `vocab_size` tokens (ids are what the tests use)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size - 1)}
    vocab["<unk>"] = vocab_size - 1
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))


def write_text_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer.json whose words are the most frequent of the embedded corpus's
    held-out text (the rest one unknown id), so that text becomes varied ids as it would with
    a real tokenizer: for tests that record routing from text."""
    from collections import Counter

    from tokenizers import Tokenizer, models, pre_tokenizers

    from moespec.demo.corpus import held_out_documents

    split = pre_tokenizers.Whitespace()
    counts = Counter(
        word for doc in held_out_documents(8, 20000) for word, _ in split.pre_tokenize_str(doc.text)
    )
    vocab = {word: i for i, (word, _) in enumerate(counts.most_common(vocab_size - 1))}
    vocab["<unk>"] = vocab_size - 1
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = split
    tokenizer.save(str(directory / "tokenizer.json"))


def save_checkpoint(model, directory: Path, **save_kwargs) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, **save_kwargs)
    write_tokenizer(directory, model.config.vocab_size)
    return directory


def edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def run_script(path, argv: list[str]):
    """A script of the repository run as a maintainer runs it (`python path ...`), importing
    this checkout's moespec."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, str(path), *argv], capture_output=True, text=True, env=env
    )
