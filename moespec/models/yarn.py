"""YaRN rotary scaling (Peng et al. 2023, "YaRN: Efficient Context Window Extension"), as
transformers computes it (`_compute_yarn_parameters`): gpt-oss uses it, DeepSeek-V2 too.

Frequencies that turn fewer than `beta_slow` times over the original context are
interpolated (divided by `factor`), those that turn more than `beta_fast` times are kept,
with a linear ramp between; cos and sin are then scaled by the attention factor
0.1 ln(factor) + 1 (or its mscale / mscale_all_dim form) unless the config gives one.
"""

import math

import torch


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(scaling: dict) -> float:
    """The factor YaRN scales cos and sin by."""
    given = scaling.get("attention_factor")
    if given is not None:
        return float(given)
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
    return _mscale(factor)


def _correction_dim(rotations: float, dim: int, base: float, context: int) -> float:
    """The rotary dimension that turns `rotations` times over `context` positions."""
    return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))


def inverse_frequencies(scaling: dict, base: float, dim: int) -> torch.Tensor:
    """YaRN's inverse frequencies [dim / 2] of a rotary embedding over `dim` dims."""
    factor = float(scaling["factor"])
    context = scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    low = _correction_dim(fast, dim, base, context)
    high = _correction_dim(slow, dim, base, context)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    positions = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return (1.0 / (factor * positions)) * (1 - keep) + (1.0 / positions) * keep
