"""The shared layers' fast forms equal their plain forms bit for bit."""

import pytest
import torch
import torch.nn.functional as F

from moespec.models.layers import attend, rms_norm, rotate


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@pytest.mark.parametrize("tokens", [1, 3, 9])
@pytest.mark.parametrize("cached", [0, 5, 150])
def test_grouped_query_rows_equal_the_library_grouped_path_in_bf16(tokens, cached):
    generator = torch.Generator().manual_seed(tokens * 1000 + cached)
    heads, kv_heads, dim, length = 4, 2, 16, cached + tokens

    def draw(*shape):
        return torch.randn(*shape, generator=generator).to(torch.bfloat16)

    q, keys, values = (
        draw(1, tokens, heads, dim),
        draw(1, kv_heads, length, dim),
        draw(1, kv_heads, length, dim),
    )
    mask = None
    if tokens > 1:
        mask = torch.arange(length)[None] <= torch.arange(cached, length)[:, None]
    expected = (
        F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True
        )
        .transpose(1, 2)
        .reshape(1, tokens, heads * dim)
    )
    assert torch.equal(attend(q, keys, values, mask), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_with_signed_sin_equals_rotate_half(dtype):
    x = torch.randn(2, 3, 6, 16).to(dtype)
    angles = torch.rand(3, 1, 8) * 10
    cos = torch.cat((angles, angles), -1).cos().to(dtype)
    sin = torch.cat((angles, angles), -1).sin()
    signed = torch.cat((-sin[..., :8], sin[..., 8:]), -1).to(dtype)
    assert torch.equal(rotate(x, cos, signed), x * cos + rotate_half(x) * sin.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_the_hugging_face_formula(dtype):
    x, weight = torch.randn(2, 5, 64).to(dtype), torch.randn(64).to(dtype)
    h = x.float()
    expected = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    assert torch.equal(rms_norm(x, weight, 1e-6), expected)
