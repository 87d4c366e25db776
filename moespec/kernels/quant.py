"""int8 weight-only quantization: one scale per output channel, symmetric, activations as they are.

A [out, in] weight W is held as int8 values Q and scales s [out] in the activation dtype, with
Q = round(W / s) clipped to [-127, 127] and s = max_j |W_ij| / 127, so that W ~ s * Q. A product
x @ W.T runs as (x @ Q.T) * s, reading one byte per weight plus the scales: 0.5 of the bf16
bytes, plus 2 bytes per output channel. Where moespec's native loops run (`moespec.kernels.
native`, bf16 activations), Q is held in their pair layout (`pack_pairs`) and the product is
theirs: each input row quantized to int16 (an error of at most 2^-16 of its largest magnitude
per input), exact int32 products, batch-invariant by construction. Elsewhere
`torch._weight_int8pack_mm`, with the activations as they are.

One scale per output channel rather than per 32-weight block (Q8_0): PyTorch has a fused kernel
for the first on every x86 CPU and none for the second; measured on one [2048, 2048] product
(benchmarks/cpu_paths.py), blocks through torch.compile ran at about half the speed.
"""

import torch

from moespec.kernels.cpu import HOST, cpu_paths
from moespec.kernels.native import (
    PAIR_GROUP,
    _threads,
    int8_pairs_product,
    native,
    pack_pairs,
    refused,
    unpack_pairs,
)

INT8_MAX = 127
# torch 2.13's AVX-512 `_weight_int8pack_mm` returns wrong values, or crashes, on bf16 and fp16
# inputs whose length is not a multiple of 16 (measured; fp32 and AVX2 are right): such
# weights (tiny test models only; real hidden sizes are multiples of 64) take the reference.
FUSED_MULTIPLE = 16


class Int8Weight:
    """A [out, in] weight as int8 values and per-output-channel scales."""

    __slots__ = ("values", "pairs", "scales", "shape", "dtype", "nbytes")

    def __init__(self, values: torch.Tensor, scales: torch.Tensor, paired: bool = False):
        if values.dtype != torch.int8 or values.dim() != 2 or scales.shape != values.shape[:1]:
            raise ValueError(
                f"int8 weight wants int8 values [out, in] and scales [out], got "
                f"{values.dtype} {tuple(values.shape)} and {tuple(scales.shape)}"
            )
        self.scales = scales.contiguous()
        self.shape, self.dtype = tuple(values.shape), scales.dtype
        self.nbytes = values.nbytes + self.scales.nbytes  # what a product reads
        # held once: as [out, in] values, or in the native pair layout (values then None)
        self.values, self.pairs = values.contiguous(), None
        if paired:
            self.values, self.pairs = None, pack_pairs(values)

    @classmethod
    def paired_from(cls, pairs: torch.Tensor, scales: torch.Tensor, shape) -> "Int8Weight":
        """An int8 weight of `shape` whose values are already in the pair layout."""
        weight = cls.__new__(cls)
        weight.values, weight.pairs, weight.scales = None, pairs, scales.contiguous()
        weight.shape, weight.dtype = tuple(shape), scales.dtype
        weight.nbytes = shape[0] * shape[1] + weight.scales.nbytes
        return weight

    def rows(self) -> torch.Tensor:
        """Q as [out, in] int8 values (a copy when held in the pair layout)."""
        if self.pairs is None:
            return self.values
        return unpack_pairs(self.pairs, self.shape)

    def dense(self) -> torch.Tensor:
        """s * Q in the scales' dtype: the weight this int8 weight stands for (a copy)."""
        return (self.rows().float() * self.scales.float()[:, None]).to(self.dtype)


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Per-output-channel symmetric int8 of a [out, in] weight; scales in the weight's dtype.
    A bf16 weight bound for the pair layout is quantized by the native loop straight into it
    (no fp32 copy; the same bits as `quantize_reference`)."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"int8 quantization wants a float [out, in] weight, got {weight.shape}")
    paired = pairs_path(weight)
    if weight.is_meta:  # a converted model's skeleton: the layout's shapes, no arithmetic
        return _meta_int8(weight, paired)
    function = getattr(native().lib, "moespec_quantize_pairs_bf16", None) if paired else None
    if function is None or weight.device.type != "cpu":
        return quantize_reference(weight, paired)
    out, inp = weight.shape
    source = weight.contiguous()
    pairs = torch.zeros(-(-out // PAIR_GROUP), -(-inp // 2), PAIR_GROUP, 2, dtype=torch.int8)
    scales = torch.empty(out, dtype=torch.bfloat16)
    args = (source.data_ptr(), out, inp, pairs.data_ptr(), scales.data_ptr(), _threads(None))
    if rc := function(*args):
        raise refused(function.__name__, rc, args)
    return Int8Weight.paired_from(pairs, scales, (out, inp))


def _meta_int8(weight: torch.Tensor, paired: bool) -> Int8Weight:
    out, inp = weight.shape
    scales = torch.empty(out, dtype=weight.dtype, device="meta")
    if not paired:
        return Int8Weight(torch.empty(out, inp, dtype=torch.int8, device="meta"), scales)
    pairs = torch.empty(
        -(-out // PAIR_GROUP), -(-inp // 2), PAIR_GROUP, 2, dtype=torch.int8, device="meta"
    )
    return Int8Weight.paired_from(pairs, scales, (out, inp))


def quantize_reference(weight: torch.Tensor, paired: bool = False) -> Int8Weight:
    """`quantize_int8` in tensor operations (fp32 copies of the weight)."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / INT8_MAX).to(weight.dtype)
    safe = scales.float().clamp_min(torch.finfo(torch.float32).tiny)  # an all-zero row stays 0
    values = torch.round(w / safe[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Weight(values, scales, paired=paired)


def pairs_path(weight: torch.Tensor) -> bool:
    """Whether an int8 weight of this float weight takes the native pair layout: bf16 on a
    CPU where the native int8 loops run."""
    return (
        weight.dtype == torch.bfloat16
        and weight.device.type in HOST
        and (cpu_paths().int8 == "native-int8-pairs")
    )


def int8_product(x: torch.Tensor, weight: Int8Weight, threads: int | None = None) -> torch.Tensor:
    """x @ (s * Q).T as (x @ Q.T) * s, for x [..., in] in the scales' dtype (threads: for the
    native loops; PyTorch's kernel follows the library's setting)."""
    if weight.pairs is not None:
        return int8_pairs_product(x, weight.pairs, weight.scales, threads)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    if weight.shape[1] % FUSED_MULTIPLE:
        return int8_reference(x, weight)
    out = torch._weight_int8pack_mm(rows, weight.values, weight.scales)  # [R, out]
    return out.view(*x.shape[:-1], weight.shape[0])


def int8_reference(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """The int8 math in plain float32: (x Q^T) s, then rounded once to x's dtype (tests)."""
    out = (x.float() @ weight.rows().float().T) * weight.scales.float()
    return out.to(x.dtype)
