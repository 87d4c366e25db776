"""The demo models' configurations (a tiny Qwen3-MoE target, a dense Qwen3 draft), their
seeded construction, and fingerprints of parameters and files."""

import hashlib
from pathlib import Path

import torch
from transformers import (
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)


def make_target_config(vocab_size: int = 4096, **overrides) -> Qwen3MoeConfig:
    """The demo target: 4 layers, hidden 256, 16 experts top-2 of width 256 (~14.4M params).

    ``router_aux_loss_coef`` is 0 because the balancing loss is our own per-layer one
    (``balance_loss``); transformers' pooled-across-layers loss would be counted twice.
    """
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        moe_intermediate_size=256,
        num_experts=16,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        intermediate_size=768,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        router_aux_loss_coef=0.0,
        eos_token_id=0,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    return Qwen3MoeConfig(**kwargs)


def make_draft_config(vocab_size: int = 4096, **overrides) -> Qwen3Config:
    """The demo draft: dense, 2 layers, hidden 256, MLP 768 (~2.6M params)."""
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=768,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=0,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    return Qwen3Config(**kwargs)


def build_model(config, seed: int) -> torch.nn.Module:
    """A freshly initialised fp32 model; the seed fixes the initial weights."""
    torch.manual_seed(seed)
    if config.model_type == "qwen3_moe":
        # grouped_mm is the fastest fp32 experts kernel on CPU (faster than bf16 here)
        return Qwen3MoeForCausalLM._from_config(config, experts_implementation="grouped_mm")
    return Qwen3ForCausalLM._from_config(config)


def parameter_fingerprint(model: torch.nn.Module) -> str:
    """sha256 over every parameter's name, dtype, shape and raw bytes (tied ones once)."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        t = p.detach().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    """Hex sha256 of one file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
