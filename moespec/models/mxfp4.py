"""MXFP4 weights (OCP Microscaling Formats v1.0), the format of the released gpt-oss experts.

A row of K weights is held as K / 32 blocks: 16 bytes of FP4 E2M1 codes, two per byte, low
nibble first ([..., G, 16] uint8 `*_blocks`), and one E8M0 scale per block, the power of two
2^(s - 127) ([..., G] uint8 `*_scales`). An E2M1 code is a sign bit, two exponent bits and
one mantissa bit: the values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives.
"""

import torch

BLOCK = 32  # weights per scale
E8M0_BIAS = 127
# E2M1 code -> value: sign in bit 3; exponent bits 2-1 (bias 1); mantissa bit 0.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0) + tuple(
    -v for v in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> weights [..., G * 32] in dtype.

    Every value is exact in float32 and bfloat16 (a 2-bit-mantissa code times a power of two)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(
            f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} disagree "
            f"(want [..., G, {BLOCK // 2}] and [..., G])"
        )
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., G, 16, 2]
    values = table[codes].flatten(-2)  # [..., G, 32]: byte j holds weights 2j, 2j + 1
    exponents = scales.to(torch.int32) - E8M0_BIAS
    weights = torch.ldexp(values, exponents.unsqueeze(-1))
    return weights.flatten(-2).to(dtype)
