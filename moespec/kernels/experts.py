"""A layer's experts held stacked: gate and up fused as [E, 2I, H], down as [E, H, I].

Most families use plain SwiGLU experts, down(silu(gate x) * up x). gpt-oss adds a bias to each
projection and clamps its SwiGLU (`ClampedSwiGLU`); the kernels apply both through
`ExpertWeights.activate` and the bias tensors, so the plain path is unchanged.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moespec.kernels.cpu import HOST, format_name
from moespec.kernels.linear import PackedWeight, dense, pack
from moespec.kernels.native import PairWeight
from moespec.kernels.quant import Int8Weight, quantize_int8


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation: gate clamped above at `limit`, up clamped to +-limit,
    then (up + 1) * gate * sigmoid(alpha gate) (transformers' GptOssExperts._apply_gate)."""

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


@dataclass
class ExpertWeights:
    """Stacked SwiGLU experts of one MoE layer (E = experts, H = hidden, I = intermediate).

    gate_up[e] = cat(gate_proj[e], up_proj[e]) so that one product gives both halves.
    After `pack()`, each expert's two matrices are held packed for the CPU's fastest library
    path (moespec.kernels.linear) and the stacked tensors keep only their shape (meta).
    After `quantize_int8()`, each expert's two matrices are int8 with one scale per output
    channel (moespec.kernels.quant), the stacked tensors again meta in the activation dtype.
    """

    gate_up: torch.Tensor  # [E, 2I, H]
    down: torch.Tensor  # [E, H, I]
    packed_gate_up: list | None = None  # [E] PackedWeight (or tensors, or Int8Weight)
    packed_down: list | None = None
    gate_up_bias: torch.Tensor | None = None  # [E, 2I] (gpt-oss), with down_bias
    down_bias: torch.Tensor | None = None  # [E, H]
    activation: ClampedSwiGLU | None = None  # None: plain SwiGLU
    # Experts still in their checkpoint (moespec.models.checkpoint.ExpertSource): the stacked
    # tensors are shape holders (meta) and `pack`, `quantize_int8` or `materialize` read one
    # expert at a time from `source.expert(e)`, so a loader never holds the layer stacked.
    source: object | None = None

    def __post_init__(self):
        e, two_i, h = self.gate_up.shape
        if two_i % 2 or self.down.shape != (e, h, two_i // 2):
            raise ValueError(
                f"expert shapes disagree: gate_up {tuple(self.gate_up.shape)}, "
                f"down {tuple(self.down.shape)} (want [E, 2I, H] and [E, H, I])"
            )
        if (self.gate_up_bias is None) != (self.down_bias is None):
            raise ValueError("expert biases come in pairs: gate_up_bias and down_bias")
        if self.has_bias and (
            self.gate_up_bias.shape != (e, two_i) or self.down_bias.shape != (e, h)
        ):
            raise ValueError(
                f"expert bias shapes disagree: gate_up_bias {tuple(self.gate_up_bias.shape)}, "
                f"down_bias {tuple(self.down_bias.shape)} (want [E, 2I] and [E, H])"
            )

    @property
    def has_bias(self) -> bool:
        return self.gate_up_bias is not None

    @property
    def is_plain_swiglu(self) -> bool:
        """Unbiased experts with the plain SwiGLU (what the Triton kernels compute)."""
        return not self.has_bias and self.activation is None

    def activate(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, 2I] gate/up products (biases added) -> [R, I] activations."""
        inter = self.intermediate_size
        gate, up = hidden[:, :inter], hidden[:, inter:]
        if self.activation is None:
            return F.silu(gate) * up
        return self.activation(gate, up)

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
        """w_l: the bytes of one expert (gate, up and down, with their biases if any) as held:
        int8 values plus their scales once quantized, which is what either kernel reads per
        expert read."""
        bias = 0
        if self.has_bias:
            bias = (self.gate_up_bias.shape[1] + self.down_bias.shape[1]) * (
                self.gate_up_bias.element_size()
            )
        if self.packed_gate_up is not None:
            return self.packed_gate_up[0].nbytes + self.packed_down[0].nbytes + bias
        elements = self.gate_up[0].numel() + self.down[0].numel()
        return elements * self.gate_up.element_size() + bias

    @property
    def is_packed(self) -> bool:
        """Held in a layout of its own (oneDNN's or int8), not as the stacked tensors."""
        return self.packed_gate_up is not None

    @property
    def device(self) -> torch.device:
        """Where the experts' products run: the CPU when packed (the oneDNN and int8 layouts
        are CPU layouts), else the stacked tensors' device."""
        return torch.device("cpu") if self.is_packed else self.gate_up.device

    @property
    def format(self) -> str:
        """The experts' weight format: "int8", or the dtype's name ("bf16", "fp32", ...)."""
        if self.packed_gate_up is not None and isinstance(self.packed_gate_up[0], Int8Weight):
            return "int8"
        return format_name(self.dtype)

    def weights(self, e: int):
        """(gate_up, down) of expert e, for `moespec.kernels.linear.linear`: packed if held so,
        else views of the stacked tensors (no copy)."""
        if self.packed_gate_up is not None:
            return self.packed_gate_up[e], self.packed_down[e]
        return self.gate_up[e], self.down[e]

    def dense_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up, down) of expert e as ordinary tensors (copied out of a packed layout)."""
        gate_up, down = self.weights(e)
        return dense(gate_up), dense(down)

    def _expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) of expert e, from the source while there is one
        (valid until the next call: copy what is kept)."""
        if self.source is not None:
            return self.source.expert(e)
        return self.gate_up[e], self.down[e]

    def pack(self) -> "ExpertWeights":
        """Pack every expert for the CPU's fast path and drop the stacked copies (in place)."""
        if self.is_packed or (self.source is None and self.gate_up.device.type not in HOST):
            return self
        gate_up, down = [], []
        for e in range(self.num_experts):
            g, d = self._expert(e)
            gate_up.append(self._own(pack(g), g))
            down.append(self._own(pack(d), d))
        if not any(isinstance(w, PackedWeight | PairWeight) for w in gate_up + down):
            return self.materialize()  # nothing pays on this CPU for this dtype and shape
        self.packed_gate_up, self.packed_down = gate_up, down
        self._drop_stacked()
        return self

    def _own(self, weight, source_tensor):
        """A weight `pack` left as it was, copied where it is a source's buffer (reused)."""
        return weight.clone() if weight is source_tensor and self.source is not None else weight

    def quantize_int8(self) -> "ExpertWeights":
        """Every expert to int8 with per-output-channel scales; drop the stacked copies (in
        place). Products then read about half the bf16 bytes (moespec.kernels.quant)."""
        if self.is_packed:
            raise ValueError("quantize the experts before packing them (they are packed)")
        gate_up, down = [], []
        for e in range(self.num_experts):
            g, d = self._expert(e)
            gate_up.append(quantize_int8(g))
            down.append(quantize_int8(d))
        self.packed_gate_up, self.packed_down = gate_up, down
        self._drop_stacked()
        return self

    def materialize(self) -> "ExpertWeights":
        """Read experts still in their checkpoint into the stacked tensors (in place)."""
        if self.source is None:
            return self
        gate_up = torch.empty(self.gate_up.shape, dtype=self.dtype, device=self.source.device)
        down = torch.empty(self.down.shape, dtype=self.dtype, device=self.source.device)
        for e in range(self.num_experts):
            gate_up[e], down[e] = self.source.expert(e)
        self._close_source()
        self.gate_up, self.down = gate_up, down
        return self

    def _drop_stacked(self) -> None:
        self.gate_up = torch.empty(self.gate_up.shape, dtype=self.dtype, device="meta")
        self.down = torch.empty(self.down.shape, dtype=self.dtype, device="meta")
        self._close_source()

    def _close_source(self) -> None:
        if self.source is not None and hasattr(self.source, "close"):
            self.source.close()
        self.source = None

    def to(self, dtype: torch.dtype) -> "ExpertWeights":
        """An unpacked copy in another dtype."""
        pairs = [self.dense_weights(e) for e in range(self.num_experts)]
        biases = (None, None)
        if self.has_bias:
            biases = (self.gate_up_bias.to(dtype), self.down_bias.to(dtype))
        return ExpertWeights(
            torch.stack([g for g, _ in pairs]).to(dtype),
            torch.stack([d for _, d in pairs]).to(dtype),
            gate_up_bias=biases[0],
            down_bias=biases[1],
            activation=self.activation,
        )
