"""Llama (`llama`), a draft model: plain attention, rope with optional Llama-3 scaling."""

from moespec.models.checkpoint import WeightLayout
from moespec.models.config import ConfigError, ModelConfig, common_fields, require

LAYOUT = WeightLayout()


def parse_config(raw: dict) -> ModelConfig:
    if raw.get("mlp_bias"):
        raise ConfigError("config.json: mlp_bias = true is not supported")
    return ModelConfig(
        **common_fields(raw),
        intermediate_size=int(require(raw, "intermediate_size")),
    )
