"""Model configuration, built from a checkpoint's own config.json.

One dataclass for every supported family; each architecture file translates its config.json
into it. Unknown keys are ignored; a missing required key is a clear error naming the file.
"""

from dataclasses import dataclass, field
from typing import Literal

QkNorm = Literal["none", "head", "projection"]
RouterScoring = Literal["softmax", "softmax_topk", "sigmoid"]
GroupScore = Literal["max", "top2"]


class ConfigError(ValueError):
    """config.json is missing a key or holds a value moespec cannot run."""


@dataclass(frozen=True)
class LatentAttentionConfig:
    """Multi-head latent attention (DeepSeek-V2 §2.1.2): keys and values come from one
    compressed latent c_KV of `kv_lora_rank` per position plus one rotary key k_R shared by
    all heads; queries come straight from h (q_lora_rank None) or through their own latent."""

    kv_lora_rank: int  # d_c
    q_lora_rank: int | None  # d'_c
    qk_nope_head_dim: int  # d_h of the latent part of q and k
    qk_rope_head_dim: int  # d_h^R of the rotary part
    v_head_dim: int
    softmax_scale: float  # 1/sqrt(d_h + d_h^R), times yarn's mscale^2 when scaled


@dataclass(frozen=True)
class GroupRouting:
    """Group-limited top-k routing (DeepSeek-V2 §2.2.2 and GLM-4.5): experts fall into
    `groups` equal groups; each token keeps its `top_groups` best groups (a group scores its
    best expert, "max", or its two best, "top2"), then its top-k experts within them.
    Weights are the scores of the chosen experts (renormalised if asked) times `scale`.
    groups = top_groups = 1 is plain top-k. `correction_bias`: sigmoid routers add a
    per-expert bias to the scores for choosing only (GLM-4.5's e_score_correction_bias;
    MiniMax-M2's, with one group). "softmax_topk": softmax over the top k logits alone
    (gpt-oss), one group, no correction bias."""

    scoring: RouterScoring = "softmax"
    groups: int = 1
    top_groups: int = 1
    group_score: GroupScore = "max"
    scale: float = 1.0
    correction_bias: bool = False


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
    tie_word_embeddings: bool = False
    intermediate_size: int = 0  # dense MLP layers
    num_experts: int = 0  # 0: a dense model
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # Which layers are MoE (the rest are dense MLP); derived when left empty.
    moe_layers: tuple[bool, ...] = ()
    routing: GroupRouting | None = None  # None: softmax over all experts, top-k
    shared_experts: int = 0  # experts every token uses, beside the routed ones
    shared_expert_size: int = 0  # their intermediate size together; 0: the routed ones' each
    rotary_dim: int = 0  # dimensions of each head that rotate (0: all of head_dim)
    latent_attention: LatentAttentionConfig | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int = 4096
    name: str = ""
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if not self.moe_layers:
            object.__setattr__(self, "moe_layers", (self.num_experts > 0,) * self.num_layers)
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
        if not 0 <= self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ConfigError(
                f"the rotary dimensions ({self.rotary_dim}) must be even and at most "
                f"head_dim ({self.head_dim})"
            )
        if self.routing is not None and self.is_moe:
            check_group_routing(self.routing, self.num_experts, self.top_k)
        if self.layer_types:
            check_layer_types(self.layer_types, self.num_layers, self.sliding_window)

    @property
    def rotary_dims(self) -> int:
        """Dimensions of each head that rotate."""
        return self.rotary_dim or self.head_dim

    @property
    def shared_intermediate_size(self) -> int:
        """The intermediate size of the shared experts as one SwiGLU MLP."""
        return self.shared_expert_size or self.shared_experts * self.moe_intermediate_size

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


def check_group_routing(routing: GroupRouting, num_experts: int, top_k: int) -> None:
    r = routing
    if r.groups < 1 or num_experts % r.groups:
        raise ConfigError(f"n_group ({r.groups}) must divide the {num_experts} routed experts")
    if not 1 <= r.top_groups <= r.groups:
        raise ConfigError(f"topk_group must be in 1..{r.groups} (n_group), got {r.top_groups}")
    if top_k > r.top_groups * (num_experts // r.groups):
        raise ConfigError(
            f"num_experts_per_tok ({top_k}) exceeds the experts of the {r.top_groups} "
            "groups a token keeps"
        )
    if r.group_score == "top2" and num_experts // r.groups < 2:
        raise ConfigError("a group scored by its two best experts needs at least 2 experts")
    if r.scoring == "softmax_topk" and (r.groups > 1 or r.correction_bias):
        raise ConfigError("a softmax over the top-k logits takes no groups or correction bias")


LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")


def check_layer_types(types: tuple[str, ...], num_layers: int, window: int | None) -> None:
    if len(types) != num_layers:
        raise ConfigError(f"layer_types has {len(types)} entries for {num_layers} layers")
    unknown = set(types) - set(LAYER_TYPES)
    if unknown:
        raise ConfigError(f"layer_types {sorted(unknown)} are not supported")
    if "sliding_attention" in types and not window:
        raise ConfigError("sliding_attention layers need a sliding_window")


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
        elif kind == "yarn":  # transformers: the top-level key first, then the scaling's
            original = raw.get("original_max_position_embeddings") or scaling.get(
                "original_max_position_embeddings"
            )
            if not original:  # transformers would take max_position_embeddings: factor 1
                raise ConfigError("rope scaling 'yarn' needs original_max_position_embeddings")
            scaling = {**scaling, "original_max_position_embeddings": original}
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


def common_fields(raw: dict, partial_rotary: float = 1.0) -> dict:
    """The keys every family shares, under their usual Hugging Face names.

    The rotary dims are `partial_rotary_factor` (top level, else in `rope_parameters`, else
    the family's `partial_rotary`) of head_dim, as transformers takes them."""
    hidden = int(require(raw, "hidden_size"))
    heads = int(require(raw, "num_attention_heads"))
    theta, scaling = rope_settings(raw)
    head_dim = int(optional(raw, "head_dim", default=hidden // heads))
    partial = optional(raw, "partial_rotary_factor", default=None)
    if partial is None:
        partial = (raw.get("rope_parameters") or {}).get("partial_rotary_factor", partial_rotary)
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
