"""Routing shapes of full-size MoE models, for synthetic traces, simulation and calibration.

Each preset gives the MoE layers L (and which decoder layers they are), the routed experts N,
the experts per token m, and the expert bytes w_l of a SwiGLU expert in bf16:
w = 3 x hidden x intermediate x 2 bytes (gate, up and down projections). Shared experts, which
every token uses, and the MLPs of dense decoder layers are read once per pass whatever the
routing: they are dense bytes, not part of a trace. `published_reuse2` and `published_reuse9`
are the layer-mean rho(2) and rho(9) that seed 000 measured on the model (§2, Fig. 1: "at n = 9
the layer mean is 0.762, 0.780 and 0.856"), where it did. `popularity_skew` is the Zipf
exponent at which the synthetic locality process fitted to rho(2) also gives rho(9)
(`routing.synthetic.fit_popularity_skew`, seed 0, 30,000 tokens) with one popularity for the
whole trace (local popularity 0; at another share the skew is refitted); a process that only
matches rho(2) at a mild skew puts 36 distinct experts in a 9-token Qwen3 window instead of the
29 that the published rho(2..9) imply.
"""

from dataclasses import dataclass

BF16_BYTES = 2


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_decoder_layers: int
    layer_indices: tuple[int, ...]  # the decoder layers that are MoE layers
    num_experts: int  # N, routed experts per MoE layer
    top_k: int  # m
    hidden_size: int
    expert_intermediate_size: int
    shared_experts: int = 0
    dense_intermediate_size: int = 0  # the SwiGLU MLP of each dense (non-MoE) decoder layer
    published_reuse2: float | None = None
    published_reuse9: float | None = None
    popularity_skew: float | None = None  # fitted to both (see the module docstring)

    def __post_init__(self):
        if not 1 <= self.top_k < self.num_experts:
            raise ValueError(f"{self.name}: top_k must be in 1..{self.num_experts - 1}")
        if not self.layer_indices or max(self.layer_indices) >= self.num_decoder_layers:
            raise ValueError(f"{self.name}: layer_indices must lie in the decoder layers")

    @property
    def num_layers(self) -> int:
        """L, the number of MoE layers."""
        return len(self.layer_indices)

    @property
    def bytes_per_expert(self) -> int:
        """w_l of one routed SwiGLU expert in bf16."""
        return 3 * self.hidden_size * self.expert_intermediate_size * BF16_BYTES

    @property
    def expert_bytes(self) -> list[int]:
        """[w_l] for every MoE layer."""
        return [self.bytes_per_expert] * self.num_layers

    @property
    def shared_expert_bytes(self) -> int:
        """Bytes of the shared experts of one MoE layer (dense: read once per pass)."""
        return self.shared_experts * self.bytes_per_expert

    @property
    def dense_mlp_bytes(self) -> int:
        """Bytes of the MLPs of all dense decoder layers (dense: read once per pass)."""
        dense_layers = self.num_decoder_layers - self.num_layers
        return dense_layers * 3 * self.hidden_size * self.dense_intermediate_size * BF16_BYTES


SHAPES: dict[str, ModelShape] = {
    shape.name: shape
    for shape in [
        ModelShape(
            name="qwen3-30b-a3b",
            num_decoder_layers=48,
            layer_indices=tuple(range(48)),
            num_experts=128,
            top_k=8,
            hidden_size=2048,
            expert_intermediate_size=768,
            published_reuse2=0.480,
            published_reuse9=0.780,
            popularity_skew=1.604,  # simulated rho(9) 0.780
        ),
        # The first decoder layer is a dense MLP (first_k_dense_replace = 1).
        ModelShape(
            name="deepseek-v2-lite",
            num_decoder_layers=27,
            layer_indices=tuple(range(1, 27)),
            num_experts=64,
            top_k=6,
            hidden_size=2048,
            expert_intermediate_size=1408,
            shared_experts=2,
            dense_intermediate_size=10944,
        ),
        # GLM-4.5-Air: transformers' Glm4MoeConfig defaults (first_k_dense_replace = 1).
        ModelShape(
            name="glm-4.5-air",
            num_decoder_layers=46,
            layer_indices=tuple(range(1, 46)),
            num_experts=128,
            top_k=8,
            hidden_size=4096,
            expert_intermediate_size=1408,
            shared_experts=1,
            dense_intermediate_size=10944,
        ),
        ModelShape(
            name="olmoe-1b-7b",
            num_decoder_layers=16,
            layer_indices=tuple(range(16)),
            num_experts=64,
            top_k=8,
            hidden_size=2048,
            expert_intermediate_size=1024,
            published_reuse2=0.363,
            published_reuse9=0.762,
            popularity_skew=1.131,  # simulated rho(9) 0.762
        ),
        ModelShape(
            name="gpt-oss-20b",
            num_decoder_layers=24,
            layer_indices=tuple(range(24)),
            num_experts=32,
            top_k=4,
            hidden_size=2880,
            expert_intermediate_size=2880,
            published_reuse2=0.492,
            published_reuse9=0.856,
            # The process reaches rho(9) = 0.819 at most with rho(2) = 0.492 (at p -> 0).
            popularity_skew=1.646,
        ),
    ]
}


def get_shape(name: str) -> ModelShape:
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown model shape {name!r} (known: {', '.join(SHAPES)})") from None
