"""Matrix products on weights packed once for the CPU's fastest library path.

PyTorch's default CPU path for a one- to few-row product with bf16 weights moves about 30 GB/s
here, and its fp32 path for 2-9 rows about 10 GB/s, while oneDNN on weights re-laid out once
(`_reorder_linear_weight`) moves 40-50 GB/s, near this machine's read bandwidth, with the same
results. `pack(weight)` returns such a packed weight where it pays (bf16 always; fp32 from
1 MiB, below which the library's fixed cost dominates); `linear(x, weight)` takes either.
"""

import torch
import torch.nn.functional as F

from moespec.kernels.invariance import chunked, is_batch_invariant
from moespec.kernels.threads import intra_op_threads, product_threads

PACK_FP32_MIN_BYTES = 1 << 20


class PackedWeight:
    """A [out, in] weight held in oneDNN's blocked layout: same bytes, faster products."""

    __slots__ = ("packed", "shape", "dtype", "nbytes")

    def __init__(self, weight: torch.Tensor):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)
        self.shape, self.dtype, self.nbytes = tuple(weight.shape), weight.dtype, weight.nbytes

    def dense(self) -> torch.Tensor:
        """The weight in its ordinary [out, in] layout (a copy)."""
        return self.packed.to_dense()


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack(weight: torch.Tensor) -> "torch.Tensor | PackedWeight":
    """The weight packed for oneDNN where that pays on this CPU, else the weight itself."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not packing_available():
        return weight
    if weight.dtype == torch.float32 and weight.nbytes < PACK_FP32_MIN_BYTES:
        return weight
    if weight.dtype not in (torch.bfloat16, torch.float32):
        return weight  # fp16 needs CPU support oneDNN may lack; the default path is fine
    try:
        return PackedWeight(weight)
    except RuntimeError:  # oneDNN refuses this dtype or shape on this CPU
        return weight


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for a dense or a packed weight; inside a model pass, on the
    threads its size calls for (moespec.kernels.threads); under batch invariance, in row
    chunks that give each row its one-row bits (moespec.kernels.invariance)."""
    rows = x.numel() // x.shape[-1]
    invariant = is_batch_invariant()
    threads = product_threads(weight.nbytes, 1 if invariant else rows)
    if threads is not None and threads != torch.get_num_threads():
        with intra_op_threads(threads):
            return _rows(x, weight, bias, invariant and rows > 1)
    return _rows(x, weight, bias, invariant and rows > 1)


def _rows(x, weight, bias, invariant: bool) -> torch.Tensor:
    if not invariant:
        return _product(x, weight, bias)
    return chunked(x, weight, lambda a, w: _product(a, w, bias), bias is not None)


def _product(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(weight, PackedWeight):
        return torch.ops.mkldnn._linear_pointwise(x, weight.packed, bias, "none", [None], "")
    return F.linear(x, weight, bias)


def dense(weight) -> torch.Tensor:
    """The ordinary tensor of a dense or packed weight."""
    return weight.dense() if isinstance(weight, PackedWeight) else weight
