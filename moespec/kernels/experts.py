"""A layer's experts held stacked: gate and up fused as [E, 2I, H], down as [E, H, I]."""

from dataclasses import dataclass, field

import torch


@dataclass
class ExpertWeights:
    """Stacked SwiGLU experts of one MoE layer (E = experts, H = hidden, I = intermediate).

    gate_up[e] = cat(gate_proj[e], up_proj[e]) so that one product gives both halves.
    """

    gate_up: torch.Tensor  # [E, 2I, H]
    down: torch.Tensor  # [E, H, I]
    # Weights re-laid out for a faster library path (e.g. oneDNN prepacked), built on first use.
    packed: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        e, two_i, h = self.gate_up.shape
        if two_i % 2 or self.down.shape != (e, h, two_i // 2):
            raise ValueError(
                f"expert shapes disagree: gate_up {tuple(self.gate_up.shape)}, "
                f"down {tuple(self.down.shape)} (want [E, 2I, H] and [E, H, I])"
            )

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.gate_up.shape[2]

    @property
    def intermediate_size(self) -> int:
        return self.down.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.gate_up.dtype

    @property
    def bytes_per_expert(self) -> int:
        """w_l: the bytes of one expert (gate, up and down)."""
        return (self.gate_up[0].numel() + self.down[0].numel()) * self.gate_up.element_size()

    def to(self, dtype: torch.dtype) -> "ExpertWeights":
        return ExpertWeights(self.gate_up.to(dtype), self.down.to(dtype))
