"""Matrix products on weights re-laid out once for the CPU's fastest path.

`pack(weight)` returns the weight in the layout of this CPU's path for its dtype
(`moespec.kernels.cpu`): bf16 in moespec's native pair layout where the native loops run
(`moespec.kernels.native`), else oneDNN's blocked layout (`_reorder_linear_weight`) where
oneDNN packs bf16; fp32 in oneDNN's layout from 1 MiB (below it the library's fixed cost
dominates; on an earlier host PyTorch's fp32 path moved about 10 GB/s for 2-9 rows against
oneDNN's 40-50). int8 weights (`moespec.kernels.quant`) take their layout when quantized.
`linear(x, weight)` takes any of them, and `linear_batch` a layer's expert products in one
native call.
"""

import torch
import torch.nn.functional as F

from moespec.kernels.cpu import HOST, cpu_paths
from moespec.kernels.invariance import chunked, is_batch_invariant
from moespec.kernels.native import PairWeight, batch_products, pairs_product
from moespec.kernels.quant import Int8Weight, int8_product
from moespec.kernels.threads import intra_op_threads, product_threads

PACK_FP32_MIN_BYTES = 1 << 20
# While set (`portable_layouts`), `pack` makes only layouts that can be written to a file and
# mapped back (the native pair layout), and leaves weights oneDNN would pack as they are.
_PORTABLE = False


class PackedWeight:
    """A [out, in] weight held in oneDNN's blocked layout: same bytes, faster products."""

    __slots__ = ("packed", "shape", "dtype", "nbytes")

    def __init__(self, weight: torch.Tensor):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)
        self.shape, self.dtype, self.nbytes = tuple(weight.shape), weight.dtype, weight.nbytes

    def dense(self) -> torch.Tensor:
        """The weight in its ordinary [out, in] layout (a copy)."""
        return self.packed.to_dense()


class portable_layouts:
    """Within this block, `pack` never returns oneDNN's opaque layout (moespec.models.converted
    writes the final layouts to disk and packs the rest for oneDNN when it loads them)."""

    def __enter__(self):
        global _PORTABLE
        self._before, _PORTABLE = _PORTABLE, True

    def __exit__(self, *exc):
        global _PORTABLE
        _PORTABLE = self._before


def packing_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this CPU's chosen path for the dtype is oneDNN's packed one."""
    return cpu_paths().path(dtype) == "onednn-packed"


def pack(weight) -> "torch.Tensor | PackedWeight | PairWeight | Int8Weight":
    """The weight in the layout of this CPU's path for its dtype (moespec.kernels.cpu): the
    native pair layout or oneDNN's blocked one, else the weight itself (int8 weights have
    their own kernel and stay as they are)."""
    if not isinstance(weight, torch.Tensor) or weight.device.type not in HOST or weight.dim() != 2:
        return weight
    if weight.dtype == torch.bfloat16 and cpu_paths().bf16 == "native-pairs":
        return PairWeight(weight)
    if _PORTABLE or (weight.dtype == torch.float32 and weight.nbytes < PACK_FP32_MIN_BYTES):
        return weight
    if not packing_available(weight.dtype):
        return weight  # fp16, or a CPU where oneDNN does not pack this dtype
    try:
        return PackedWeight(weight)
    except RuntimeError:  # oneDNN refuses this dtype or shape on this CPU
        return weight


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for a dense or a packed weight; inside a model pass, on the
    threads its size calls for (moespec.kernels.threads); under batch invariance, in row
    chunks that give each row its one-row bits (moespec.kernels.invariance)."""
    rows = x.numel() // x.shape[-1]
    if isinstance(weight, PairWeight) or getattr(weight, "groups", None) is not None:
        # the native layouts: batch-invariant by construction, never chunked
        return _product(x, weight, bias, product_threads(weight.nbytes, rows))
    invariant = is_batch_invariant()
    threads = product_threads(weight.nbytes, 1 if invariant else rows)
    if threads is not None and threads != torch.get_num_threads():
        with intra_op_threads(threads):
            return _rows(x, weight, bias, invariant and rows > 1)
    return _rows(x, weight, bias, invariant and rows > 1)


def linear_batch(x, weights: list, xrow, count, orow, out_rows: int) -> torch.Tensor | None:
    """Several products of one shape in one call where the weights are in a native layout
    (`moespec.kernels.native.batch_products`: product k takes rows xrow[k] .. of x, count[k]
    of them, into rows orow[k] .. of the result), on the threads the batch's bytes call for;
    each row gets the bits `linear` gives it. None where the weights take `linear` instead."""
    if not weights or not isinstance(weights[0], PairWeight | Int8Weight):
        return None
    threads = product_threads(sum(w.nbytes for w in weights), 1)
    return batch_products(x, weights, xrow, count, orow, out_rows, threads)


def _rows(x, weight, bias, invariant: bool) -> torch.Tensor:
    if not invariant:
        return _product(x, weight, bias)
    return chunked(x, weight, lambda a, w: _product(a, w, bias), bias is not None)


def _product(x: torch.Tensor, weight, bias: torch.Tensor | None, threads=None) -> torch.Tensor:
    if isinstance(weight, PairWeight):
        out = pairs_product(x, weight, threads)
        return out if bias is None else out + bias
    if isinstance(weight, PackedWeight):
        return torch.ops.mkldnn._linear_pointwise(x, weight.packed, bias, "none", [None], "")
    if isinstance(weight, Int8Weight):
        out = int8_product(x, weight, threads)
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)


def dense(weight) -> torch.Tensor:
    """The ordinary tensor of a dense, packed or int8 weight."""
    return weight.dense() if isinstance(weight, PackedWeight | PairWeight | Int8Weight) else weight
