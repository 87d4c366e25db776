"""Logits parity with Hugging Face `transformers` on tiny random checkpoints it writes itself."""

import pytest
import torch

from moespec.models import load_model
from tests.checkpoints import MOE_FAMILIES, hf_model, save_checkpoint

pytest.importorskip("transformers")

TOKENS = torch.tensor([[5, 17, 33, 2, 90, 41, 7, 12, 60, 3, 3, 3, 44, 17, 5]])
KERNELS = ["reference", "slot", "dedup", "dedup-linear"]


def reference_logits(hf, tokens=TOKENS):
    with torch.no_grad():
        return hf(tokens).logits.float()


@pytest.mark.parametrize("kernel", KERNELS)
def test_prefill_logits_match_transformers_fp32(checkpoint_dir, family, kernel):
    directory, hf = checkpoint_dir(family)
    model, _ = load_model(directory, dtype="fp32")
    logits = model(TOKENS, model.new_cache(), kernel=kernel, all_logits=True)
    assert (logits - reference_logits(hf)).abs().max() <= 1e-4


@pytest.mark.parametrize("kernel", KERNELS)
def test_cached_decode_logits_match_transformers_fp32(checkpoint_dir, family, kernel):
    directory, hf = checkpoint_dir(family)
    model, _ = load_model(directory, dtype="fp32")
    cache = model.new_cache(capacity=4)  # small: the cache must grow as it goes
    model(TOKENS[:, :5], cache, kernel=kernel)
    steps = [model(TOKENS[:, i : i + 1], cache, kernel=kernel) for i in range(5, TOKENS.shape[1])]
    assert (torch.cat(steps, dim=1) - reference_logits(hf)[:, 5:]).abs().max() <= 1e-4


@pytest.mark.parametrize("kernel", ["slot", "dedup"])
def test_multi_token_passes_after_a_cache_match_transformers(checkpoint_dir, family, kernel):
    # A verification pass: several tokens at once on top of cached positions.
    directory, hf = checkpoint_dir(family)
    model, _ = load_model(directory, dtype="fp32")
    cache = model.new_cache()
    model(TOKENS[:, :6], cache, kernel="dedup")
    logits = model(TOKENS[:, 6:11], cache, kernel=kernel, all_logits=True)
    assert (logits - reference_logits(hf)[:, 6:11]).abs().max() <= 1e-4


def test_bf16_logits_stay_close_to_transformers_fp32(checkpoint_dir, family):
    # bf16 keeps 8 mantissa bits: what holds is agreement to a few hundredths in logits
    # of magnitude ~1, and the same greedy token at nearly every position.
    directory, hf = checkpoint_dir(family)
    model, _ = load_model(directory, dtype="bf16")
    logits = model(TOKENS, model.new_cache(), kernel="slot", all_logits=True)
    reference = reference_logits(hf)
    assert (logits - reference).abs().max() <= 0.1 * max(1.0, reference.abs().max().item())
    agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean()
    assert agree >= 0.8


@pytest.mark.parametrize("kernel", ["slot", "dedup"])
def test_greedy_generation_is_token_identical_to_transformers_generate(
    checkpoint_dir, family, kernel
):
    from moespec.decoding import KernelPolicy, generate

    directory, hf = checkpoint_dir(family)
    model, _ = load_model(directory, dtype="fp32")
    prompt = TOKENS[0, :6].tolist()
    with torch.no_grad():
        expected = hf.generate(
            TOKENS[:, :6], max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, 6:].tolist()
    records = generate(model, prompt, max_tokens=20, kernels=KernelPolicy(kernel))
    assert [t for r in records for t in r.tokens] == expected


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    hf = hf_model("qwen3_moe")
    single = save_checkpoint(hf, tmp_path / "single")
    sharded = save_checkpoint(hf, tmp_path / "sharded", max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    a, _ = load_model(single, dtype="fp32")
    b, _ = load_model(sharded, dtype="fp32")
    for la, lb in zip(a.layers, b.layers, strict=True):
        assert torch.equal(la.attention.qkv, lb.attention.qkv)
        if hasattr(la.mlp, "experts"):
            assert torch.equal(la.mlp.experts.gate_up, lb.mlp.experts.gate_up)
            assert torch.equal(la.mlp.experts.down, lb.mlp.experts.down)
    # Equal weights; BLAS results may still differ in the last bit with memory alignment.
    assert torch.allclose(a(TOKENS, a.new_cache()), b(TOKENS, b.new_cache()), atol=1e-6)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_fused_expert_tensors_load_like_per_expert_ones(tmp_path, family):
    from safetensors.torch import load_file, save_file

    hf = hf_model(family)
    directory = save_checkpoint(hf, tmp_path / "fused")
    tensors = load_file(directory / "model.safetensors")
    prefix = "block_sparse_moe" if family == "mixtral" else "mlp"
    names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    experts = hf.config.num_local_experts if family == "mixtral" else hf.config.num_experts
    for layer in range(hf.config.num_hidden_layers):
        base = f"model.layers.{layer}.{prefix}.experts"
        if f"{base}.0.{names[0]}.weight" not in tensors:
            continue  # a dense layer
        per = {n: [tensors.pop(f"{base}.{e}.{n}.weight") for e in range(experts)] for n in names}
        gate_up = [torch.cat([g, u]) for g, u in zip(per[names[0]], per[names[1]], strict=True)]
        tensors[f"{base}.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{base}.down_proj"] = torch.stack(per[names[2]])
    save_file(tensors, directory / "model.safetensors")
    model, _ = load_model(directory, dtype="fp32")
    logits = model(TOKENS, model.new_cache(), all_logits=True)
    assert (logits - reference_logits(hf)).abs().max() <= 1e-4


def test_mixtral_sliding_window_matches_transformers(tmp_path):
    hf = hf_model("mixtral", sliding_window=4)
    directory = save_checkpoint(hf, tmp_path / "window")
    model, _ = load_model(directory, dtype="fp32")
    cache = model.new_cache()
    model(TOKENS[:, :7], cache)
    steps = [model(TOKENS[:, i : i + 1], cache) for i in range(7, TOKENS.shape[1])]
    reference = reference_logits(hf)
    assert (torch.cat(steps, dim=1) - reference[:, 7:]).abs().max() <= 1e-4
