"""Every expert kernel against the plain reference over a grid of shapes, dtypes and routings."""

import itertools

import pytest
import torch

from moespec.kernels import KERNELS, ExpertWeights, get_kernel

HIDDEN, INTER = 48, 24
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def routing(kind: str, n: int, top_k: int, num_experts: int, generator):
    """Expert ids [n, m]: all tokens on the same experts, all distinct, or random."""
    if kind == "same":
        return torch.arange(top_k).repeat(n, 1)
    if kind == "distinct":
        return torch.randperm(num_experts, generator=generator)[: n * top_k].view(n, top_k)
    return torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(n)])


GRID = [
    (n, top_k, experts, kind)
    for n, (top_k, experts), kind in itertools.product(
        range(1, 10), [(1, 4), (2, 8), (4, 16), (8, 64)], ["same", "distinct", "random"]
    )
    if kind != "distinct" or n * top_k <= experts
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kernel", sorted(set(KERNELS) - {"reference"}))
@pytest.mark.parametrize("n, top_k, num_experts, kind", GRID)
def test_kernel_matches_reference(kernel, dtype, n, top_k, num_experts, kind):
    generator = torch.Generator().manual_seed(n * 1000 + top_k * 10 + num_experts)
    experts = ExpertWeights(
        torch.randn(num_experts, 2 * INTER, HIDDEN, generator=generator).to(dtype) * 0.2,
        torch.randn(num_experts, HIDDEN, INTER, generator=generator).to(dtype) * 0.2,
    )
    x = torch.randn(n, HIDDEN, generator=generator).to(dtype)
    ids = routing(kind, n, top_k, num_experts, generator)
    weights = torch.softmax(torch.randn(n, top_k, generator=generator), -1)
    expected = KERNELS["reference"](x.float(), ids, weights, experts.to(torch.float32))
    got = get_kernel(kernel)(x, ids, weights, experts)
    assert got.dtype == dtype and got.shape == x.shape
    scale = expected.abs().max().item()
    assert (got.float() - expected).abs().max().item() <= TOLERANCE[dtype] * max(scale, 1.0)


def test_unknown_kernel_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown expert kernel 'fast'"):
        get_kernel("fast")


def test_expert_weights_refuse_mismatched_shapes():
    with pytest.raises(ValueError, match="expert shapes disagree"):
        ExpertWeights(torch.zeros(4, 8, 6), torch.zeros(4, 6, 5))


def test_bytes_per_expert_counts_gate_up_and_down():
    experts = ExpertWeights(torch.zeros(4, 8, 6, dtype=torch.bfloat16), torch.zeros(4, 6, 4))
    assert experts.bytes_per_expert == (8 * 6 + 6 * 4) * 2


def test_fp32_dedup_on_prepacked_weights_matches_reference():
    # Experts of >= 1 MiB take the oneDNN-prepacked path for passes of 2+ rows.
    from moespec.kernels.dedup import PACKED_MIN_BYTES

    generator = torch.Generator().manual_seed(0)
    hidden, inter = 512, 512
    experts = ExpertWeights(
        torch.randn(4, 2 * inter, hidden, generator=generator) * 0.05,
        torch.randn(4, hidden, inter, generator=generator) * 0.05,
    )
    assert experts.down[0].nbytes >= PACKED_MIN_BYTES
    x = torch.randn(5, hidden, generator=generator)
    ids = torch.tensor([[0, 1], [1, 0], [0, 2], [1, 3], [0, 1]])
    weights = torch.softmax(torch.randn(5, 2, generator=generator), -1)
    got = get_kernel("dedup")(x, ids, weights, experts)
    assert set(experts.packed["gate_up"]) == {0, 1}  # only the experts with 2+ rows
    expected = KERNELS["reference"](x, ids, weights, experts)
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()
