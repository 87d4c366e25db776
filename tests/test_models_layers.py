"""The shared layers' fast forms equal their plain forms bit for bit."""

import pytest
import torch
import torch.nn.functional as F

from moespec.kernels.isa import this_cpu
from moespec.kernels.native import attention_function, family_lacks, unavailable_here
from moespec.models.layers import attend, rms_norm, rotate

# skipped with the machine's own reason only: where it has the loops, a build without them fails
NO_ATTENTION = unavailable_here() or family_lacks("attention", this_cpu()[2])
needs_native_attention = pytest.mark.skipif(NO_ATTENTION is not None, reason=str(NO_ATTENTION))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@pytest.mark.parametrize("tokens", [3, 9] + ([] if attention_function() else [1]))
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


@needs_native_attention
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 2), (8, 2), (16, 2)])
@pytest.mark.parametrize("cached", [0, 7, 300])
def test_one_row_bf16_attention_is_native_up_to_4_heads_per_key_head(heads, kv_heads, cached):
    """One-row bf16 attention over a cache view: within one rounding of the float64 value on
    the native path (at most 4 query heads per key head), else the library's bits."""
    assert attention_function() is not None  # the machine has it: the build must too
    generator = torch.Generator().manual_seed(heads * 1000 + cached)
    dim, length = 24, cached + 1  # 24: a ragged end on both ISAs' vectors
    store = torch.randn(2, 1, kv_heads, length + 9, dim, generator=generator).bfloat16()
    keys, values = store[0, :, :, :length], store[1, :, :, :length]  # the cache's narrowed views
    q = torch.randn(1, 1, heads, dim, generator=generator).bfloat16()
    got = attend(q, keys, values, None)
    group = heads // kv_heads
    if group > 4:
        library = F.scaled_dot_product_attention(q.view(1, kv_heads, group, dim), keys, values)
        assert torch.equal(got, library.reshape(1, 1, heads * dim))
        return
    rows = q.double().view(kv_heads, group, dim)
    probs = torch.softmax(rows @ keys.double()[0].transpose(-1, -2) * dim**-0.5, dim=-1)
    want = (probs @ values.double()[0]).reshape(1, 1, heads * dim)
    bound = want.abs() * 2.0**-8 + values.double().abs().max() * 2.0**-16
    assert (got.double() - want).abs().le(bound).all()
    # its bits depend neither on the cache's strides nor on the threads
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        assert torch.equal(attend(q, keys.clone(), values.clone(), None), got)
    finally:
        torch.set_num_threads(threads)


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


@needs_native_attention
@pytest.mark.parametrize("heads, kv_heads", [(8, 1), (6, 1), (12, 2)])
def test_native_attention_gives_each_head_the_bits_it_gets_alone(heads, kv_heads):
    """Query heads are swept up to 4 at a time per key head: a head's bits are the same in
    any sweep, and within one rounding of the float64 attention."""
    from moespec.kernels.native import attend_one

    assert attention_function() is not None  # the machine has it: the build must too

    generator = torch.Generator().manual_seed(heads)
    dim, length = 40, 70
    keys, values = torch.randn(2, 1, kv_heads, length, dim, generator=generator).bfloat16()
    q = torch.randn(1, 1, heads, dim, generator=generator).bfloat16()
    together = attend_one(q, keys, values, 0.125).view(heads, dim)
    group = heads // kv_heads
    for h in range(heads):
        c = h // group
        alone = attend_one(q[:, :, h : h + 1], keys[:, c : c + 1], values[:, c : c + 1], 0.125)
        assert torch.equal(together[h], alone.view(dim)), h
    rows = q.double().view(kv_heads, group, dim)
    probs = torch.softmax(rows @ keys.double()[0].transpose(-1, -2) * 0.125, dim=-1)
    want = (probs @ values.double()[0]).reshape(heads, dim)
    bound = want.abs() * 2.0**-8 + values.double().abs().max() * 2.0**-16
    assert (together.double() - want).abs().le(bound).all()
