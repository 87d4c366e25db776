"""gpt-oss: its expert function, MXFP4 expert weights, the features its checkpoint exercises,
and its load errors. (Logits and generation parity run in test_models_parity.py.)"""

import dataclasses
import itertools
import math

import pytest
import torch

from moespec.kernels import KERNELS, ExpertWeights, reference_experts
from moespec.kernels.experts import ClampedSwiGLU
from moespec.models import CheckpointError, load_model
from moespec.models.mxfp4 import dequantize
from tests.checkpoints import edit_config, hf_model, save_checkpoint

pytest.importorskip("transformers")

TOKENS = torch.tensor([[5, 17, 33, 2, 90, 41, 7, 12, 60, 3, 3, 3, 44, 17, 5]])


def logits_of(model, tokens=TOKENS):
    return model(tokens, model.new_cache(), all_logits=True)


def biased_experts(num_experts, dtype, generator, hidden=48, inter=24) -> ExpertWeights:
    def rand(*shape):
        return (torch.randn(*shape, generator=generator) * 0.3).to(dtype)

    return ExpertWeights(
        rand(num_experts, 2 * inter, hidden),
        rand(num_experts, hidden, inter),
        gate_up_bias=rand(num_experts, 2 * inter),
        down_bias=rand(num_experts, hidden),
        activation=ClampedSwiGLU(alpha=1.702, limit=0.5),
    )


GRID = list(itertools.product([1, 2, 5, 9], [(1, 4), (2, 8), (4, 16)]))
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kernel", sorted(set(KERNELS) - {"reference"}))
@pytest.mark.parametrize("n, routing", GRID)
def test_every_kernel_matches_the_reference_on_biased_clamped_experts(kernel, dtype, n, routing):
    top_k, num_experts = routing
    generator = torch.Generator().manual_seed(n * 100 + num_experts)
    experts = biased_experts(num_experts, dtype, generator)
    x = torch.randn(n, 48, generator=generator).to(dtype)
    ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(n)])
    weights = torch.softmax(torch.randn(n, top_k, generator=generator), dim=-1)
    expected = reference_experts(x, ids, weights, experts)
    if kernel != "dedup-linear":  # the others also run on packed weights, as a model holds them
        experts.pack()
    got = KERNELS[kernel](x, ids, weights, experts)
    scale = max(1.0, expected.abs().max().item())
    assert (got.float() - expected.float()).abs().max() <= TOLERANCE[dtype] * scale


def test_loaded_experts_compute_what_transformers_gpt_oss_experts_compute(checkpoint_dir):
    # The checkpoint's interleaved gate/up columns, biases and clamp, through our reference.
    directory, hf = checkpoint_dir("gpt_oss")
    model, _ = load_model(directory, dtype="fp32", pack=False)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(7, hf.config.hidden_size, generator=generator)
    ids = torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(7)])
    weights = torch.softmax(torch.randn(7, 2, generator=generator), dim=-1)
    for i, block in model.moe_blocks.items():
        with torch.no_grad():
            expected = hf.model.layers[i].mlp.experts(x, ids, weights)
        assert (reference_experts(x, ids, weights, block.experts) - expected).abs().max() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mxfp4_dequantisation_equals_transformers(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(100, 150, (3, 10, 4), dtype=torch.uint8, generator=generator)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]
    assert torch.equal(dequantize(blocks, scales, dtype), theirs.transpose(1, 2))


def test_mxfp4_codes_are_the_e2m1_values_times_the_block_scale():
    # byte 0x71: low nibble 1 (+0.5) first, high nibble 7 (+6.0); 0xF8: -0.0 then -6.0
    blocks = torch.tensor([[[0x71, 0xF8] + [0] * 14]], dtype=torch.uint8)
    scales = torch.tensor([[129]], dtype=torch.uint8)  # 2^(129 - 127) = 4
    values = dequantize(blocks, scales, torch.float32)[0]
    assert values[:4].tolist() == [2.0, 24.0, -0.0, -24.0] and not values[4:].any()


def mxfp4_checkpoint(directory):
    """A gpt-oss checkpoint whose experts are MXFP4 (random codes and scales), with the
    transformers model holding them as transformers dequantises them."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = hf_model("gpt_oss")
    c = hf.config
    generator = torch.Generator().manual_seed(1)
    quantized = {}
    shapes = {"gate_up_proj": (2 * c.intermediate_size, c.hidden_size)}
    shapes["down_proj"] = (c.hidden_size, c.intermediate_size)
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            for name, (rows, columns) in shapes.items():
                size = (c.num_local_experts, rows, columns // 32)
                blocks = torch.randint(0, 256, (*size, 16), dtype=torch.uint8, generator=generator)
                scales = torch.randint(121, 125, size, dtype=torch.uint8, generator=generator)
                dense = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
                getattr(layer.mlp.experts, name).copy_(dense)
                quantized[f"model.layers.{i}.mlp.experts.{name}"] = (blocks, scales)
    save_checkpoint(hf, directory)
    tensors = load_file(directory / "model.safetensors")
    for name, (blocks, scales) in quantized.items():
        del tensors[name]
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, directory / "model.safetensors")
    edit_config(directory, quantization_config={"quant_method": "mxfp4"})
    return directory, hf


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory):
    return mxfp4_checkpoint(tmp_path_factory.mktemp("gpt_oss_mxfp4"))


@pytest.mark.parametrize("kernel", ["reference", "slot", "dedup"])
def test_an_mxfp4_checkpoint_matches_transformers_on_its_dequantised_weights(mxfp4_dir, kernel):
    directory, hf = mxfp4_dir
    model, _ = load_model(directory, dtype="fp32")
    with torch.no_grad():
        expected = hf(TOKENS).logits
    logits = model(TOKENS, model.new_cache(), kernel=kernel, all_logits=True)
    assert (logits - expected).abs().max() <= 1e-4


def without_sinks(model):
    for layer in model.layers:
        layer.attention.sinks = None


def full_attention(model):
    model.config = dataclasses.replace(model.config, layer_types=("full_attention",) * 3)


def unclamped(model):
    for block in model.moe_blocks.values():
        block.experts.activation = ClampedSwiGLU(limit=math.inf)


@pytest.mark.parametrize("change", [without_sinks, full_attention, unclamped])
def test_the_checkpoint_exercises_sinks_window_and_clamp(checkpoint_dir, change):
    # Each feature changes the logits: parity on this checkpoint checks all of them.
    directory, _ = checkpoint_dir("gpt_oss")
    model, _ = load_model(directory, dtype="fp32")
    before = logits_of(model)
    change(model)
    assert (logits_of(model) - before).abs().max() > 1e-2


def test_a_sink_of_the_wrong_shape_names_file_and_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    directory = save_checkpoint(hf_model("gpt_oss"), tmp_path / "bad")
    tensors = load_file(directory / "model.safetensors")
    tensors["model.layers.1.self_attn.sinks"] = torch.zeros(3)
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.1\."
                       r"self_attn\.sinks' has shape \[3\], expected \[4\]"):  # fmt: skip
        load_model(directory)


def test_an_unknown_quantization_method_is_refused(tmp_path):
    directory = save_checkpoint(hf_model("gpt_oss"), tmp_path / "fp8")
    edit_config(directory, quantization_config={"quant_method": "fp8"})
    with pytest.raises(CheckpointError, match=r"config\.json: .*quant_method 'fp8' is not"):
        load_model(directory)


@pytest.mark.parametrize("part", ["blocks", "scales"])
def test_missing_mxfp4_blocks_or_scales_name_the_tensor(mxfp4_dir, tmp_path, part):
    import shutil

    from safetensors.torch import load_file, save_file

    directory = tmp_path / "partial"
    shutil.copytree(mxfp4_dir[0], directory)
    tensors = load_file(directory / "model.safetensors")
    name = f"model.layers.2.mlp.experts.down_proj_{part}"
    del tensors[name]
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' is missing from {directory}"):
        load_model(directory)


def test_mxfp4_blocks_of_a_float_dtype_are_refused(mxfp4_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    directory = tmp_path / "float_blocks"
    shutil.copytree(mxfp4_dir[0], directory)
    tensors = load_file(directory / "model.safetensors")
    name = "model.layers.0.mlp.experts.gate_up_proj_blocks"
    tensors[name] = tensors[name].float()
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' has dtype torch.float32; "):
        load_model(directory)


def test_offloading_refuses_experts_its_slots_cannot_hold(checkpoint_dir):
    from moespec.offload.engine.tiers import CpuBackend, ExpertStore

    model, _ = load_model(checkpoint_dir("gpt_oss")[0], dtype="fp32", pack=False)
    experts = [block.experts for block in model.moe_blocks.values()]
    with pytest.raises(ValueError, match="plain SwiGLU experts only"):
        ExpertStore(experts, CpuBackend())
