"""Qwen3 dense (`qwen3`), a draft model: RMSNorm on each head's q and k, SwiGLU MLP."""

from moespec.models.checkpoint import WeightLayout
from moespec.models.config import ModelConfig, common_fields, require

LAYOUT = WeightLayout()


def parse_config(raw: dict) -> ModelConfig:
    return ModelConfig(
        **common_fields(raw),
        qk_norm="head",
        intermediate_size=int(require(raw, "intermediate_size")),
    )
