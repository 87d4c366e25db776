"""Model configuration, built from a checkpoint's own config.json.

One dataclass for every supported family; each architecture file translates its config.json
into it. Unknown keys are ignored; a missing required key is a clear error naming the file.
"""

from dataclasses import dataclass, field
from typing import Literal

QkNorm = Literal["none", "head", "projection"]
Scoring = Literal["softmax", "softmax_topk", "sigmoid"]


class ConfigError(ValueError):
    """config.json is missing a key or holds a value moespec cannot run."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # "none": plain attention; "head": RMSNorm of each head's q and k (Qwen3);
    # "projection": RMSNorm of the whole q and k projections (OLMoE).
    qk_norm: QkNorm = "none"
    rope_scaling: dict | None = None
    attention_bias: bool = False
    clip_qkv: float | None = None
    sliding_window: int | None = None
    # Per layer "full_attention", "sliding_attention" (gpt-oss) or "linear_attention"
    # (Qwen3.5's Gated DeltaNet); empty: every layer slides when `sliding_window` is set.
    layer_types: tuple[str, ...] = ()
    attention_sinks: bool = False  # a learned logit per head in each softmax (gpt-oss)
    rotary_dim: int = 0  # the leading dims of each head that rotate; 0: all (head_dim)
    tie_word_embeddings: bool = False
    intermediate_size: int = 0  # dense MLP layers
    num_experts: int = 0  # 0: a dense model
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    router_scoring: Scoring = "softmax"  # moespec.models.moe.route
    # Which layers are MoE (the rest are dense MLP); derived when left empty.
    moe_layers: tuple[bool, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int = 4096
    name: str = ""
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if not self.moe_layers:
            object.__setattr__(self, "moe_layers", (self.num_experts > 0,) * self.num_layers)
        if not self.rotary_dim:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        for key in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be positive, got {getattr(self, key)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if len(self.moe_layers) != self.num_layers:
            raise ConfigError(
                f"moe_layers has {len(self.moe_layers)} entries for {self.num_layers}"
            )
        if self.is_moe:
            if not 1 <= self.top_k <= self.num_experts:
                raise ConfigError(
                    f"num_experts_per_tok must be in 1..{self.num_experts}, got {self.top_k}"
                )
            if self.moe_intermediate_size < 1:
                raise ConfigError("the experts' intermediate size must be positive")
        if not all(self.moe_layers) and self.intermediate_size < 1:
            raise ConfigError("dense layers need a positive intermediate_size")
        if not 2 <= self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ConfigError(f"rotary dims must be even and in 2..{self.head_dim}")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise ConfigError(
                    f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
                )
            unknown = set(self.layer_types) - {
                "full_attention",
                "sliding_attention",
                "linear_attention",
            }
            if unknown:
                raise ConfigError(f"layer_types {sorted(unknown)} are not supported")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ConfigError("sliding_attention layers need a sliding_window")

    @property
    def attention_windows(self) -> tuple[int | None, ...]:
        """The sliding window of each layer's attention (None: full attention)."""
        if not self.layer_types:
            return (self.sliding_window,) * self.num_layers
        return tuple(
            self.sliding_window if kind == "sliding_attention" else None
            for kind in self.layer_types
        )

    @property
    def is_moe(self) -> bool:
        return any(self.moe_layers)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)


def require(raw: dict, *keys: str, source: str = "config.json"):
    """The value of the first of `keys` present in raw, else a ConfigError naming them."""
    for key in keys:
        if raw.get(key) is not None:
            return raw[key]
    raise ConfigError(f"{source} has no {' or '.join(repr(k) for k in keys)}")


def optional(raw: dict, *keys: str, default=None):
    for key in keys:
        if raw.get(key) is not None:
            return raw[key]
    return default


def rope_settings(raw: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling) from either transformers 4 keys or transformers 5 `rope_parameters`."""
    params = raw.get("rope_parameters") or {}
    theta = optional(raw, "rope_theta", default=params.get("rope_theta", 10000.0))
    scaling = raw.get("rope_scaling") or None
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ("default", "linear", "llama3", "yarn"):
            raise ConfigError(
                f"rope scaling type {kind!r} is not supported (default, linear, llama3, yarn)"
            )
        if kind == "default":
            scaling = None
        needed = ("factor", "original_max_position_embeddings")
        if kind == "yarn" and not all(scaling.get(key) for key in needed):
            raise ConfigError(f"rope scaling 'yarn' needs {' and '.join(needed)}")
    return float(theta), scaling


def eos_ids(*values) -> tuple[int, ...]:
    """Stop tokens from config.json / generation_config.json (an int or a list)."""
    ids: list[int] = []
    for value in values:
        if value is None:
            continue
        for item in value if isinstance(value, list) else [value]:
            if item not in ids:
                ids.append(int(item))
    return tuple(ids)


def common_fields(raw: dict) -> dict:
    """The keys every family shares, under their usual Hugging Face names."""
    hidden = int(require(raw, "hidden_size"))
    heads = int(require(raw, "num_attention_heads"))
    theta, scaling = rope_settings(raw)
    head_dim = int(optional(raw, "head_dim", default=hidden // heads))
    partial = optional(raw, "partial_rotary_factor", default=None)
    if partial is None:
        partial = (raw.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
    return {
        "model_type": raw["model_type"],
        "vocab_size": int(require(raw, "vocab_size")),
        "hidden_size": hidden,
        "num_layers": int(require(raw, "num_hidden_layers")),
        "num_heads": heads,
        "num_kv_heads": int(optional(raw, "num_key_value_heads", default=heads)),
        "head_dim": head_dim,
        "rotary_dim": int(head_dim * float(partial)),
        "rms_norm_eps": float(optional(raw, "rms_norm_eps", default=1e-6)),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "attention_bias": bool(optional(raw, "attention_bias", default=False)),
        "tie_word_embeddings": bool(optional(raw, "tie_word_embeddings", default=False)),
        "bos_token_id": optional(raw, "bos_token_id"),
        "eos_token_ids": eos_ids(raw.get("eos_token_id")),
        "max_position_embeddings": int(optional(raw, "max_position_embeddings", default=4096)),
        "name": str(optional(raw, "_name_or_path", "name", default="")),
    }
