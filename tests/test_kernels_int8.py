"""int8 weight-only experts: the quantization, the int8 product against its plain float32
reference, both expert kernels against the reference expert operation on the same int8
experts, and a tiny model's int8 logits against its float ones."""

import pytest
import torch

from moespec.kernels import KERNELS, ExpertWeights, get_kernel
from moespec.kernels.invariance import batch_invariance
from moespec.kernels.linear import linear
from moespec.kernels.quant import Int8Weight, int8_reference, quantize_int8

HIDDEN, INTER = 48, 32  # multiples of 16: the fused int8 kernel (moespec.kernels.quant)
# int8 product vs its float32 reference: the same integer dot products, rounded differently
# (float32: accumulation order; bf16: the output's one rounding, 2^-8 relative).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def random_experts(num_experts: int, dtype: torch.dtype, seed: int = 0) -> ExpertWeights:
    generator = torch.Generator().manual_seed(seed)
    return ExpertWeights(
        (torch.randn(num_experts, 2 * INTER, HIDDEN, generator=generator) * 0.2).to(dtype),
        (torch.randn(num_experts, HIDDEN, INTER, generator=generator) * 0.2).to(dtype),
    )


def test_quantization_is_within_half_a_step_of_each_weight():
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    weight[3] = 0  # an all-zero channel stays zero (no division by a zero scale)
    q = quantize_int8(weight)
    assert q.rows().dtype == torch.int8 and q.rows().abs().max() <= 127
    step = q.scales[:, None]
    assert ((q.dense() - weight).abs() <= step / 2 + 1e-7).all()
    assert torch.equal(q.dense()[3], torch.zeros(64))
    assert q.nbytes == 32 * 64 + 32 * 4  # one byte per weight, one float32 scale per channel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 2, 5, 9])
def test_int8_product_matches_its_float32_reference(dtype, rows):
    generator = torch.Generator().manual_seed(rows)
    weight = quantize_int8(torch.randn(40, 64, generator=generator).to(dtype))
    x = torch.randn(rows, 64, generator=generator).to(dtype)
    bias = torch.randn(40, generator=generator).to(dtype)
    got = linear(x, weight, bias)
    expected = (int8_reference(x, weight).float() + bias.float()).to(dtype)
    assert got.dtype == dtype and got.shape == (rows, 40)
    scale = expected.float().abs().max().item()
    assert (got.float() - expected.float()).abs().max().item() <= TOLERANCE[dtype] * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int8_product_of_an_input_length_the_fused_kernel_gets_wrong_is_right(dtype):
    generator = torch.Generator().manual_seed(2)
    weight = quantize_int8(torch.randn(40, 24, generator=generator).to(dtype))
    x = torch.randn(3, 24, generator=generator).to(dtype)
    expected = int8_reference(x, weight).float()
    scale = expected.abs().max().item()
    assert (linear(x, weight).float() - expected).abs().max().item() <= TOLERANCE[dtype] * scale


def test_int8_weight_refuses_values_that_are_not_int8():
    with pytest.raises(ValueError, match="int8 values"):
        Int8Weight(torch.zeros(4, 4), torch.ones(4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kernel", ["slot", "dedup"])
@pytest.mark.parametrize("n, top_k, num_experts", [(1, 2, 8), (4, 2, 8), (9, 8, 64), (3, 4, 4)])
def test_int8_kernels_match_the_reference_on_the_same_int8_experts(
    kernel, dtype, n, top_k, num_experts
):
    generator = torch.Generator().manual_seed(n * 100 + top_k)
    experts = random_experts(num_experts, dtype, seed=n).quantize_int8()
    assert experts.format == "int8" and experts.is_packed
    x = torch.randn(n, HIDDEN, generator=generator).to(dtype)
    ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(n)])
    weights = torch.softmax(torch.randn(n, top_k, generator=generator), -1)
    # the reference loops over (token, slot) on the dequantized experts s * Q, in float32
    expected = KERNELS["reference"](x.float(), ids, weights, experts.to(torch.float32))
    got = get_kernel(kernel)(x, ids, weights, experts)
    assert got.dtype == dtype and got.shape == x.shape
    scale = max(expected.abs().max().item(), 1.0)
    tolerance = {torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
    assert (got.float() - expected).abs().max().item() <= tolerance * scale


def test_int8_experts_read_one_byte_per_weight_plus_scales():
    experts = random_experts(4, torch.bfloat16)
    dense_bytes = experts.bytes_per_expert
    experts.quantize_int8()
    weights = 2 * INTER * HIDDEN + HIDDEN * INTER
    assert dense_bytes == 2 * weights
    assert experts.bytes_per_expert == weights + 2 * (2 * INTER + HIDDEN)  # bf16 scales


def test_dedup_linear_refuses_int8_experts():
    experts = random_experts(2, torch.bfloat16).quantize_int8()
    with pytest.raises(ValueError, match="needs unpacked expert weights"):
        get_kernel("dedup-linear")(
            torch.randn(1, HIDDEN).bfloat16(), torch.tensor([[0]]), torch.ones(1, 1), experts
        )


def test_int8_experts_cannot_be_quantized_twice():
    experts = random_experts(2, torch.bfloat16).quantize_int8()
    with pytest.raises(ValueError, match="they are packed"):
        experts.quantize_int8()


@pytest.mark.parametrize("kernel", ["slot", "dedup"])
def test_batch_invariant_int8_kernels_give_each_row_its_one_row_bits(kernel):
    generator = torch.Generator().manual_seed(5)
    experts = random_experts(16, torch.bfloat16).quantize_int8()
    x = torch.randn(9, HIDDEN, generator=generator).bfloat16()
    ids = torch.stack([torch.randperm(16, generator=generator)[:4] for _ in range(9)])
    ids[1] = ids[0]  # repeated experts within a pass: deduplication groups rows
    weights = torch.softmax(torch.randn(9, 4, generator=generator), -1)
    run = get_kernel(kernel)
    with batch_invariance(True):
        alone = torch.cat(
            [run(x[i : i + 1], ids[i : i + 1], weights[i : i + 1], experts) for i in range(9)]
        )
        for n in range(1, 10):
            assert torch.equal(run(x[:n], ids[:n], weights[:n], experts), alone[:n]), n


@pytest.mark.parametrize("weights", ["int8", "int8-experts"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_int8_model_logits_stay_close_to_the_float_model(checkpoint_dir, dtype, weights):
    from moespec.models import load_model

    directory, _ = checkpoint_dir("qwen3_moe")
    plain, _ = load_model(directory, dtype)
    int8, _ = load_model(directory, dtype, weights=weights)
    assert int8.expert_format == "int8" and plain.expert_format == dtype
    assert int8.dense_format == ("int8" if weights == "int8" else dtype)
    assert int8.parameter_bytes()["experts"] < 0.6 * plain.parameter_bytes()["experts"]
    tokens = torch.arange(1, 17)
    expected = plain(tokens, plain.new_cache(), all_logits=True)
    for kernel in ("slot", "dedup"):
        got = int8(tokens, int8.new_cache(), all_logits=True, kernel=kernel)
        # weights off by half a quantization step each: logits move by ~1e-3 of their scale
        # here; 2% bounds that with room and fails on a wrong scale or layout
        assert (got - expected).abs().max() <= 0.02 * expected.abs().max(), kernel


def test_load_model_refuses_float_weights_of_another_dtype(checkpoint_dir):
    from moespec.models import load_model

    directory, _ = checkpoint_dir("qwen3_moe")
    with pytest.raises(ValueError, match="weights fp32 disagree with the dtype"):
        load_model(directory, "bf16", weights="fp32")


def test_the_expert_benchmark_times_int8_experts_at_their_int8_bytes():
    from moespec.calibrate.bench import BenchSettings, ExpertOpBenchmark

    experts = random_experts(8, torch.bfloat16).quantize_int8()
    settings = BenchSettings(pass_sizes=(2,), chosen_levels=1, repeats=1, warmup=0, flush_bytes=0)
    bench = ExpertOpBenchmark({0: experts}, top_k=2, settings=settings)
    record = bench.measure(bench.cases()[0], flush=None)
    assert record["expert_bytes"] == experts.bytes_per_expert < 2 * INTER * HIDDEN * 3
    assert record["median"] > 0


@pytest.mark.parametrize("family", ["deepseek_v2", "glm4_moe"])
def test_int8_quantizes_latent_attention_and_shared_experts(checkpoint_dir, family):
    from moespec.models import load_model
    from moespec.models.moe import MoEBlock

    directory, _ = checkpoint_dir(family)
    plain, _ = load_model(directory, "fp32")
    int8, _ = load_model(directory, "fp32", weights="int8")
    for layer in int8.layers:
        assert all(isinstance(w, Int8Weight) for w in layer.attention.products())
        shared = layer.mlp.shared if isinstance(layer.mlp, MoEBlock) else layer.mlp
        assert shared is None or all(isinstance(w, Int8Weight) for w in shared.products())
    assert int8.parameter_bytes()["dense"] < 0.6 * plain.parameter_bytes()["dense"]
    tokens = torch.arange(1, 17)
    expected = plain(tokens, plain.new_cache(), all_logits=True)
    got = int8(tokens, int8.new_cache(), all_logits=True)
    # the tiny GLM's logits move by up to 10% of their scale with int8 attention (its
    # products alone stay within 1%): only DeepSeek-V2's are bounded as tightly as Qwen3's
    bound = 0.02 if family == "deepseek_v2" else 0.2
    assert (got - expected).abs().max() <= bound * expected.abs().max()
