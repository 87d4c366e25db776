"""Every expert kernel against the plain reference over a grid of shapes, dtypes and routings."""

import itertools

import pytest
import torch

from moespec.kernels import KERNELS, ExpertWeights, get_kernel
from moespec.kernels.cpu import cpu_paths
from moespec.kernels.linear import pack

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


def packs_bf16() -> bool:
    """Whether bf16 weights take a layout of their own on this CPU: the native pair layout
    (AVX-512-BF16) or oneDNN's (AVX-512 BW/VL)."""
    return not isinstance(pack(torch.zeros(16, 16, dtype=torch.bfloat16)), torch.Tensor)


NO_BF16_PACKING = cpu_paths().fallback("bf16") or "bf16 weights are packed here"

# Packed cases are bf16 only: fp32 experts this small are never packed (below 1 MiB;
# test_kernels_on_packed_fp32_experts_match_reference packs larger ones), and dedup-linear
# refuses packed weights (test_dedup_linear_refuses_packed_experts).
KERNEL_WEIGHTS = [
    (kernel, dtype, packed)
    for kernel in sorted(set(KERNELS) - {"reference"})
    for dtype, packed in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True))
    if not (packed and kernel == "dedup-linear")
]


@pytest.mark.parametrize(
    "kernel, dtype, packed",
    KERNEL_WEIGHTS,
    ids=[
        f"{k}-{'fp32' if d == torch.float32 else 'bf16'}-{'packed' if p else 'dense'}"
        for k, d, p in KERNEL_WEIGHTS
    ],
)
@pytest.mark.parametrize("n, top_k, num_experts, kind", GRID)
def test_kernel_matches_reference(kernel, dtype, n, top_k, num_experts, kind, packed):
    generator = torch.Generator().manual_seed(n * 1000 + top_k * 10 + num_experts)
    experts = ExpertWeights(
        torch.randn(num_experts, 2 * INTER, HIDDEN, generator=generator).to(dtype) * 0.2,
        torch.randn(num_experts, HIDDEN, INTER, generator=generator).to(dtype) * 0.2,
    )
    x = torch.randn(n, HIDDEN, generator=generator).to(dtype)
    ids = routing(kind, n, top_k, num_experts, generator)
    weights = torch.softmax(torch.randn(n, top_k, generator=generator), -1)
    expected = KERNELS["reference"](x.float(), ids, weights, experts.to(torch.float32))
    if packed:
        if not packs_bf16():
            pytest.skip(NO_BF16_PACKING)
        assert experts.pack().is_packed
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


@pytest.mark.parametrize("kernel", ["slot", "dedup"])
def test_kernels_on_packed_fp32_experts_match_reference(kernel):
    # Experts of >= 1 MiB in fp32 are packed for oneDNN; products of 1 and of 2+ rows.
    generator = torch.Generator().manual_seed(0)
    hidden, inter = 512, 512
    experts = ExpertWeights(
        torch.randn(4, 2 * inter, hidden, generator=generator) * 0.05,
        torch.randn(4, hidden, inter, generator=generator) * 0.05,
    )
    reference = ExpertWeights(experts.gate_up.clone(), experts.down.clone())
    assert experts.pack().is_packed
    x = torch.randn(5, hidden, generator=generator)
    ids = torch.tensor([[0, 1], [1, 0], [0, 2], [1, 3], [0, 1]])
    weights = torch.softmax(torch.randn(5, 2, generator=generator), -1)
    got = get_kernel(kernel)(x, ids, weights, experts)
    expected = KERNELS["reference"](x, ids, weights, reference)
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_packing_keeps_the_weights_exactly():
    if not packs_bf16():
        pytest.skip(NO_BF16_PACKING)
    generator = torch.Generator().manual_seed(1)
    experts = ExpertWeights(
        torch.randn(3, 16, 12, generator=generator).bfloat16(),
        torch.randn(3, 12, 8, generator=generator).bfloat16(),
    )
    dense = [(experts.gate_up[e].clone(), experts.down[e].clone()) for e in range(3)]
    experts.pack()
    assert experts.is_packed and experts.gate_up.device.type == "meta"
    for e, (gate_up, down) in enumerate(dense):
        got_gate_up, got_down = experts.dense_weights(e)
        assert torch.equal(got_gate_up, gate_up) and torch.equal(got_down, down)
    assert experts.bytes_per_expert == (16 * 12 + 12 * 8) * 2


def test_dedup_linear_refuses_packed_experts():
    if not packs_bf16():
        pytest.skip(NO_BF16_PACKING)
    experts = ExpertWeights(torch.randn(2, 8, 6).bfloat16(), torch.randn(2, 6, 4).bfloat16()).pack()
    with pytest.raises(ValueError, match="needs unpacked expert weights"):
        get_kernel("dedup-linear")(
            torch.randn(1, 6).bfloat16(), torch.tensor([[0]]), torch.ones(1, 1), experts
        )


def test_without_bf16_packing_the_weights_stay_dense_and_the_kernels_run():
    # The fallback of a CPU without bf16 packing: pack() keeps the ordinary tensor, and the
    # experts stay unpacked (on a CPU that packs, this checks the same call the other way).
    weight = torch.randn(16, 16).bfloat16()
    packed = pack(weight)
    experts = ExpertWeights(torch.randn(2, 8, 6).bfloat16(), torch.randn(2, 6, 4).bfloat16())
    assert experts.pack().is_packed == packs_bf16()
    if not packs_bf16():
        assert packed is weight
    x, ids = torch.randn(1, 6).bfloat16(), torch.tensor([[1]])
    assert get_kernel("slot")(x, ids, torch.ones(1, 1), experts).shape == (1, 6)


# The kernel and layout pairs of the grid (dedup-linear refuses packed weights).
@pytest.mark.parametrize(
    "kernel, packed",
    sorted({(k, p) for k, _, p in KERNEL_WEIGHTS}),
    ids=lambda v: v if isinstance(v, str) else ("packed" if v else "dense"),
)
@pytest.mark.parametrize("top_k, num_experts", [(2, 8), (8, 64)])
def test_batch_invariant_kernels_give_each_row_its_one_row_bits(kernel, packed, top_k, num_experts):
    from moespec.kernels.invariance import batch_invariance

    if packed and not packs_bf16():
        pytest.skip(NO_BF16_PACKING)
    generator = torch.Generator().manual_seed(top_k)
    experts = ExpertWeights(
        torch.randn(num_experts, 2 * INTER, HIDDEN, generator=generator).bfloat16() * 0.2,
        torch.randn(num_experts, HIDDEN, INTER, generator=generator).bfloat16() * 0.2,
    )
    if packed:
        experts.pack()
    x = torch.randn(9, HIDDEN, generator=generator).bfloat16()
    ids = routing("random", 9, top_k, num_experts, generator)
    ids[1] = ids[0]  # repeated experts within a pass: deduplication groups rows
    weights = torch.softmax(torch.randn(9, top_k, generator=generator), -1)
    run = get_kernel(kernel)
    with batch_invariance(True):
        alone = torch.cat(
            [run(x[i : i + 1], ids[i : i + 1], weights[i : i + 1], experts) for i in range(9)]
        )
        for n in range(1, 10):
            assert torch.equal(run(x[:n], ids[:n], weights[:n], experts), alone[:n]), n


def test_batch_invariant_products_of_large_weights_give_each_row_its_one_row_bits():
    # A shape where the library's kernel choice moves with the rows (here, from 5 rows).
    from moespec.kernels.invariance import batch_invariance, invariant_rows
    from moespec.kernels.linear import _product, linear

    generator = torch.Generator().manual_seed(3)
    weight = pack(torch.randn(2048, 2048, generator=generator).bfloat16())
    x = torch.randn(9, 2048, generator=generator).bfloat16()
    alone = torch.cat([linear(x[i : i + 1], weight) for i in range(9)])
    with batch_invariance(True):
        chunk = invariant_rows(weight, lambda a, w: _product(a, w, None))
        for n in range(1, 10):
            assert torch.equal(linear(x[:n], weight), alone[:n]), (n, chunk)
