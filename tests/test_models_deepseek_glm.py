"""DeepSeek-V2 (latent attention, shared experts, dense first layer) and GLM-4.5 (sigmoid
router with a choice bias, partial rotary) against transformers, in the engine's loops, and in
the cost model's split of a pass's bytes. The common parity tests over every family (prefill,
cached decode, multi-token passes, greedy generation) run on both in test_models_parity.py."""

import json

import pytest
import torch

from moespec.models import CheckpointError, load_model
from moespec.models.cache import LatentCache
from tests.checkpoints import FAMILIES, edit_config, hf_model, save_checkpoint

pytest.importorskip("transformers")

TOKENS = torch.tensor([[5, 17, 33, 2, 90, 41, 7, 12, 60, 3, 3, 3, 44, 17, 5]])
NEW = ["deepseek_v2", "glm4_moe"]
# DeepSeek-V2-Lite's own choices: q straight from h, greedy top-k, scaling factor 1, yarn
# with mscale = mscale_all_dim (its config.json's rope_scaling, at a tiny context: the
# factor is the ratio of the contexts, 512 / 64, as 163840 / 4096 is V2-Lite's).
LITE = dict(
    q_lora_rank=None,
    topk_method="greedy",
    n_group=1,
    topk_group=1,
    routed_scaling_factor=1.0,
    attention_bias=False,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 64,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "beta_fast": 32,
        "beta_slow": 1,
    },
)


def reference_logits(hf, tokens=TOKENS):
    with torch.no_grad():
        return hf(tokens).logits.float()


@pytest.fixture(scope="module")
def lite(tmp_path_factory):
    hf = hf_model("deepseek_v2", **LITE)
    return save_checkpoint(hf, tmp_path_factory.mktemp("lite")), hf


@pytest.mark.parametrize("kernel", ["reference", "slot", "dedup"])
def test_lite_prefill_cached_decode_and_verify_passes_match_transformers(lite, kernel):
    directory, hf = lite
    model, _ = load_model(directory, dtype="fp32")
    reference = reference_logits(hf)
    prefill = model(TOKENS, model.new_cache(), kernel=kernel, all_logits=True)
    assert (prefill - reference).abs().max() <= 1e-4
    cache = model.new_cache(capacity=4)  # small: the compressed cache must grow
    model(TOKENS[:, :5], cache, kernel=kernel)
    steps = [model(TOKENS[:, i : i + 1], cache, kernel=kernel) for i in range(5, 9)]
    verify = model(TOKENS[:, 9:14], cache, kernel=kernel, all_logits=True)
    assert (torch.cat(steps, dim=1) - reference[:, 5:9]).abs().max() <= 1e-4
    assert (verify - reference[:, 9:14]).abs().max() <= 1e-4


@pytest.mark.parametrize("kernel", ["slot", "dedup"])
def test_glm_air_choices_match_transformers(tmp_path, kernel):
    # GLM-4.5-Air: no q/k norms, one group of experts (plain top-k of the biased scores).
    hf = hf_model("glm4_moe", use_qk_norm=False, n_group=1, topk_group=1)
    model, _ = load_model(save_checkpoint(hf, tmp_path / "air"), dtype="fp32")
    reference = reference_logits(hf)
    cache = model.new_cache()
    model(TOKENS[:, :6], cache, kernel=kernel)
    steps = [model(TOKENS[:, i : i + 1], cache, kernel=kernel) for i in range(6, 9)]
    verify = model(TOKENS[:, 9:], cache, kernel=kernel, all_logits=True)
    assert (torch.cat([*steps, verify], dim=1) - reference[:, 6:]).abs().max() <= 1e-4


def test_latent_cache_holds_the_compressed_rows_only(checkpoint_dir):
    model, _ = load_model(checkpoint_dir("deepseek_v2")[0], dtype="fp32")
    cache = model.new_cache(capacity=8)
    model(TOKENS[:, :6], cache)
    config = FAMILIES["deepseek_v2"]
    assert isinstance(cache, LatentCache) and cache.values == []
    width = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    assert [tuple(k.shape) for k in cache.keys] == [(1, 1, 8, width)] * 3
    assert cache.layer_bytes(6) == 6 * width * 4


@pytest.mark.parametrize("family", NEW)
def test_rollback_forgets_rejected_positions(checkpoint_dir, family):
    directory, hf = checkpoint_dir(family)
    model, _ = load_model(directory, dtype="fp32")
    reference = reference_logits(hf)
    cache = model.new_cache()
    model(TOKENS[:, :6], cache)
    model(torch.tensor([[1, 2, 3, 4]]), cache)  # four drafts, all rejected
    cache.rollback(6)
    logits = model(TOKENS[:, 6:10], cache, all_logits=True)
    assert (logits - reference[:, 6:10]).abs().max() <= 1e-4


@pytest.mark.parametrize("family", NEW)
def test_routing_sink_sees_each_moe_layers_routed_experts_as_transformers_routes(
    checkpoint_dir, family
):
    directory, hf = checkpoint_dir(family)
    model, _ = load_model(directory, dtype="fp32")
    seen = {}
    model(
        TOKENS, model.new_cache(), routing_sink=lambda layer, ids, w: seen.update({layer: (ids, w)})
    )
    captured = {}
    hooks = [
        layer.mlp.gate.register_forward_hook(
            lambda module, args, out, i=i: captured.update({i: (out[2], out[1])})
        )
        for i, layer in enumerate(hf.model.layers)
        if hasattr(layer.mlp, "gate")
    ]
    reference_logits(hf)
    for hook in hooks:
        hook.remove()
    assert sorted(seen) == sorted(captured) == [1, 2]  # layer 0 is dense: no routing
    for layer, (ids, weights) in seen.items():
        hf_ids, hf_weights = captured[layer]
        assert ids.shape == (TOKENS.shape[1], FAMILIES[family]["num_experts_per_tok"])
        ours, theirs = ids.sort(-1), hf_ids.sort(-1)
        assert torch.equal(ours.values, theirs.values)
        assert torch.allclose(
            weights.gather(1, ours.indices), hf_weights.gather(1, theirs.indices), atol=1e-6
        )


def test_group_limited_routing_keeps_the_best_groups_only():
    from moespec.models.config import GroupRouting
    from moespec.models.moe import route_groups

    generator = torch.Generator().manual_seed(0)
    x, router = torch.randn(64, 16, generator=generator), torch.randn(8, 16, generator=generator)
    routing = GroupRouting(scoring="softmax", groups=4, top_groups=1, scale=3.0)
    weights, ids = route_groups(x, router, 2, False, routing)
    probs = torch.softmax(x @ router.T, dim=-1)
    best_group = probs.view(64, 4, 2).max(-1).values.argmax(-1)
    assert torch.equal(ids.sort(-1).values, (2 * best_group[:, None] + torch.arange(2)))
    assert torch.allclose(weights, 3.0 * probs.gather(1, ids))


@pytest.mark.parametrize("family", NEW)
def test_fused_expert_tensors_load_like_per_expert_ones(tmp_path, family):
    from safetensors.torch import load_file, save_file

    hf = hf_model(family)
    directory = save_checkpoint(hf, tmp_path / "fused")
    tensors = load_file(directory / "model.safetensors")
    names = ("gate_proj", "up_proj", "down_proj")
    for layer in (1, 2):
        base = f"model.layers.{layer}.mlp.experts"
        per = {n: [tensors.pop(f"{base}.{e}.{n}.weight") for e in range(8)] for n in names}
        gate_up = [torch.cat([g, u]) for g, u in zip(per["gate_proj"], per["up_proj"], strict=True)]
        tensors[f"{base}.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{base}.down_proj"] = torch.stack(per["down_proj"])
    save_file(tensors, directory / "model.safetensors")
    model, _ = load_model(directory, dtype="fp32")
    logits = model(TOKENS, model.new_cache(), all_logits=True)
    assert (logits - reference_logits(hf)).abs().max() <= 1e-4


def test_yarn_rope_matches_transformers_on_llama_too(tmp_path):
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    yarn["original_max_position_embeddings"] = 128  # 512 / 4
    hf = hf_model("llama", rope_scaling=None, rope_parameters=yarn)
    model, _ = load_model(save_checkpoint(hf, tmp_path / "llama"), dtype="fp32")
    logits = model(TOKENS, model.new_cache(), all_logits=True)
    assert (logits - reference_logits(hf)).abs().max() <= 1e-4


def _without(directory, name):
    from safetensors.torch import load_file, save_file

    tensors = load_file(directory / "model.safetensors")
    if name.endswith("!shape"):
        name = name.removesuffix("!shape")
        tensors[name] = tensors[name][:-1]
    else:
        del tensors[name]
    save_file(tensors, directory / "model.safetensors")
    return name


@pytest.mark.parametrize(
    "family, tensor, message",
    [
        ("deepseek_v2", "model.layers.1.self_attn.kv_a_proj_with_mqa.weight", "is missing"),
        ("deepseek_v2", "model.layers.0.self_attn.kv_b_proj.weight!shape", "has shape"),
        ("deepseek_v2", "model.layers.2.mlp.shared_experts.down_proj.weight", "is missing"),
        ("glm4_moe", "model.layers.1.mlp.gate.e_score_correction_bias", "is missing"),
        ("glm4_moe", "model.layers.0.mlp.up_proj.weight", "is missing"),
    ],
)
def test_a_bad_tensor_is_one_checkpoint_error_naming_it(
    checkpoint_dir, tmp_path, family, tensor, message
):
    import shutil

    directory = tmp_path / family
    shutil.copytree(checkpoint_dir(family)[0], directory)
    name = _without(directory, tensor)
    with pytest.raises(CheckpointError, match=message) as error:
        load_model(directory, dtype="fp32")
    text = str(error.value)
    assert name in text and "model.safetensors" in text and "\n" not in text


@pytest.mark.parametrize(
    "family, change, message",
    [
        ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method 'noaux_tc' is not supported"),
        ("deepseek_v2", {"kv_lora_rank": None}, "no 'kv_lora_rank'"),
        ("glm4_moe", {"n_group": 3}, "n_group \\(3\\) must divide"),
    ],
)
def test_a_bad_config_is_one_checkpoint_error_naming_the_file(
    checkpoint_dir, tmp_path, family, change, message
):
    import shutil

    directory = tmp_path / family
    shutil.copytree(checkpoint_dir(family)[0], directory)
    edit_config(directory, **change)
    with pytest.raises(CheckpointError, match=message) as error:
        load_model(directory, dtype="fp32")
    assert "config.json" in str(error.value)


@pytest.mark.parametrize("family", NEW)
@pytest.mark.parametrize("kernel", ["slot", "dedup"])
def test_greedy_speculative_output_equals_plain_greedy(checkpoint_dir, family, kernel):
    from moespec.decoding import (
        DraftLengthPolicy,
        KernelPolicy,
        ModelDrafter,
        OracleDrafter,
        PromptLookupDrafter,
        Sampler,
        generate,
    )
    from moespec.decoding.setup import greedy_reference

    model, _ = load_model(checkpoint_dir(family)[0], dtype="fp32")
    prompt, vocab, kernels = (
        [5, 17, 33, 2, 5, 17, 40, 41],
        model.config.vocab_size,
        KernelPolicy(kernel),
    )
    plain = [t for r in generate(model, prompt, max_tokens=16, kernels=kernels) for t in r.tokens]
    reference = greedy_reference(model, prompt, 16)
    for k in (1, 3, 6):
        for drafter in (
            OracleDrafter(reference, len(prompt), 0.6, vocab, seed=1),
            ModelDrafter(model, Sampler(), vocab),  # the target as its own draft
            PromptLookupDrafter(),
        ):
            records = list(
                generate(
                    model, prompt, max_tokens=16, kernels=kernels, drafter=drafter,
                    draft_policy=DraftLengthPolicy(k),
                )
            )  # fmt: skip
            assert [t for r in records for t in r.tokens] == plain, (drafter, k)
            if isinstance(drafter, OracleDrafter):  # drafts were rejected: rollbacks ran
                assert sum(r.drafted for r in records) > sum(r.accepted for r in records)


@pytest.mark.parametrize("family", NEW)
def test_batch_invariant_bf16_speculation_equals_plain_greedy(checkpoint_dir, family):
    # Latent attention's per-head products run one token at a time under batch invariance,
    # as a one-token pass runs them: the bits of plain decoding, whatever k.
    from moespec.decoding import DraftLengthPolicy, KernelPolicy, OracleDrafter, generate
    from moespec.decoding.setup import greedy_reference

    model, _ = load_model(checkpoint_dir(family)[0], dtype="bf16")
    model.batch_invariant = True
    prompt = [5, 17, 33, 2, 5, 17, 40, 41] * 3
    for kernel in ("slot", "dedup"):
        kernels = KernelPolicy(kernel)
        plain = [
            t for r in generate(model, prompt, max_tokens=24, kernels=kernels) for t in r.tokens
        ]
        reference = greedy_reference(model, prompt, 24)
        for k in (1, 3, 5, 8):
            drafter = OracleDrafter(reference, len(prompt), 0.6, model.config.vocab_size, seed=k)
            records = generate(
                model, prompt, max_tokens=24, kernels=kernels, drafter=drafter,
                draft_policy=DraftLengthPolicy(k),
            )  # fmt: skip
            assert [t for r in records for t in r.tokens] == plain, (kernel, k)


def expected_dense_bytes(raw: dict, element: int = 4) -> dict:
    """D and its parts from config.json alone: every weight a pass reads once whatever the
    routing, besides the embedding table (the routed experts are what deduplicates)."""
    h, layers, dense_layers = raw["hidden_size"], raw["num_hidden_layers"], 1
    experts, inter = raw["n_routed_experts"], raw["moe_intermediate_size"]
    heads, bias = raw["num_attention_heads"], raw["attention_bias"]
    if raw["model_type"] == "deepseek_v2":
        c, q, p, r, v = (raw[k] for k in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                                           "qk_rope_head_dim", "v_head_dim"))  # fmt: skip
        attention = q * h + q + heads * (p + r) * q + (bias * q)  # q_a, its norm, q_b (+ bias)
        attention += (c + r) * h + c + heads * (p + v) * c + h * heads * v  # kv_a, norm, kv_b, o
        attention += bias * ((c + r) + h)
        router = experts * h
    else:
        d, kv = raw["head_dim"], raw["num_key_value_heads"]
        attention = (heads + 2 * kv) * d * h + bias * (heads + 2 * kv) * d + h * heads * d
        attention += 2 * d  # per-head q and k norms
        router = experts * h + experts  # and the choice bias
    shared = 3 * h * inter * raw["n_shared_experts"]
    dense_mlp = 3 * h * raw["intermediate_size"]
    moe_layers = layers - dense_layers
    total = layers * (attention + 2 * h) + moe_layers * (router + shared)
    total += dense_layers * dense_mlp + h + raw["vocab_size"] * h  # final norm, output head
    return {
        "dense": total * element,
        "shared": moe_layers * shared * element,
        "dense_mlp": dense_layers * dense_mlp * element,
        "expert": 3 * h * inter * element,
    }


@pytest.fixture(scope="module", params=NEW)
def planned(request, checkpoint_dir, tmp_path_factory):
    """`moespec trace` then `moespec plan --model` on the family's tiny checkpoint (with a
    tokenizer that reads text), at the smallest settings."""
    import shutil

    from moespec.cli import main
    from moespec.demo.corpus import held_out_documents
    from tests.checkpoints import write_text_tokenizer

    root = tmp_path_factory.mktemp(f"plan_{request.param}")
    directory = root / "model"
    shutil.copytree(checkpoint_dir(request.param)[0], directory)
    write_text_tokenizer(directory, 96)
    (root / "docs").mkdir()
    for i, document in enumerate(held_out_documents(4, 1200)):
        (root / "docs" / f"d{i}.txt").write_text(document.text)
    trace = root / "trace.parquet"
    assert main(["trace", "--model", str(directory), "--corpus", str(root / "docs"),
                 "--out", str(trace), "--dtype", "fp32"]) == 0  # fmt: skip
    out = root / "plan"
    assert main(["plan", "--model", str(directory), "--trace", str(trace), "--out", str(out),
                 "--dtype", "fp32", "--max-n", "3", "--repeats", "1", "--windows", "2",
                 "--flush-mib", "0", "--verify-repeats", "1", "--json"]) == 0  # fmt: skip
    raw = json.loads((directory / "config.json").read_text())
    return json.loads((out / "plan.json").read_text()), raw, trace


def test_trace_records_the_moe_layers_routed_experts_only(planned):
    from moespec.routing.store import read_trace

    plan, raw, path = planned
    trace = read_trace(path)
    assert trace.layer_indices == [1, 2] and trace.top_k == raw["num_experts_per_tok"]
    assert trace.expert_bytes == [expected_dense_bytes(raw)["expert"]] * 2


def test_plan_splits_routed_expert_bytes_from_dense_bytes(planned):
    plan, raw, _ = planned
    expected, got = expected_dense_bytes(raw), plan["bytes"]
    assert got["expert_bytes"] == [expected["expert"]] * 2
    assert got["dense_bytes"] == expected["dense"]
    assert got["shared_expert_bytes"] == expected["shared"] > 0
    assert got["dense_mlp_bytes"] == expected["dense_mlp"] > 0
    top_k, total = raw["num_experts_per_tok"], 2 * expected["expert"]
    assert got["pass_bytes"]["slot"] == [expected["dense"] + n * top_k * total for n in (1, 2, 3)]
    # One token reads m experts either way; from two on, deduplication reads fewer or equal.
    dedup = got["pass_bytes"]["dedup"]
    assert dedup[0] == got["pass_bytes"]["slot"][0]
    assert all(d <= s for d, s in zip(dedup, got["pass_bytes"]["slot"], strict=True))
    assert len(plan["step_times"]) == 3 and plan["model"]["model_type"] == raw["model_type"]
