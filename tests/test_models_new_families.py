"""gpt-oss, MiniMax-M2 and Qwen3.5-MoE through the engine: cache rollback, speculation,
routing as transformers routes, `moespec trace` and `moespec plan --model` on their tiny
checkpoints."""

import pytest
import torch

from moespec.cli import main
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
from moespec.models import load_model
from moespec.routing.store import read_trace

pytest.importorskip("transformers")

ARCHITECTURES = ["gpt_oss", "minimax_m2", "qwen3_5_moe_text"]
TOKENS = torch.tensor([[5, 17, 33, 2, 90, 41, 7, 12, 60, 3, 3, 3, 44, 17, 5]])
PROMPT = [5, 17, 33, 2, 5, 17, 40, 41]


@pytest.mark.parametrize("kernel", ["slot", "dedup"])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_rejected_drafts_roll_back_and_decoding_goes_on_as_transformers(
    checkpoint_dir, architecture, kernel
):
    # Verification passes of the true token and two wrong drafts, each rolled back to the
    # true token; past gpt-oss's window of 4, so sliding layers see rolled-back positions
    # too, and through Qwen3.5's recurrent states, restored from their snapshots.
    directory, hf = checkpoint_dir(architecture)
    model, _ = load_model(directory, dtype="fp32")
    cache = model.new_cache(capacity=4)
    model(TOKENS[:, :6], cache, kernel=kernel)
    logits = []
    for start in (6, 9, 12):
        wrong = (TOKENS[:, start + 1 : start + 3] + 1) % 95
        verify = torch.cat([TOKENS[:, start : start + 1], wrong], dim=1)
        logits.append(model(verify, cache, kernel=kernel, all_logits=True)[:, :1])
        cache.rollback(start + 1)
        logits.append(model(TOKENS[:, start + 1 : start + 3], cache, all_logits=True))
    with torch.no_grad():
        expected = hf(TOKENS).logits[:, 6:]
    assert (torch.cat(logits, dim=1) - expected).abs().max() <= 1e-4


@pytest.fixture(scope="module")
def draft(checkpoint_dir):
    return load_model(checkpoint_dir("qwen3")[0], dtype="fp32")[0]  # a dense draft, same vocab


@pytest.mark.parametrize("drafter", ["model", "oracle", "lookup"])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_greedy_speculative_output_equals_plain_greedy(
    checkpoint_dir, draft, architecture, drafter
):
    target, _ = load_model(checkpoint_dir(architecture)[0], dtype="fp32")
    kernels = KernelPolicy("dedup")
    plain = [t for r in generate(target, PROMPT, max_tokens=16, kernels=kernels) for t in r.tokens]
    for k in (1, 3, 6):
        if drafter == "model":
            source = ModelDrafter(draft, Sampler(), target.config.vocab_size)
        elif drafter == "oracle":  # accepts about 60% of drafts: rollbacks at every k
            reference = greedy_reference(target, PROMPT, 16)
            source = OracleDrafter(reference, len(PROMPT), 0.6, target.config.vocab_size, seed=1)
        else:
            source = PromptLookupDrafter()
        records = list(
            generate(
                target,
                PROMPT,
                max_tokens=16,
                kernels=kernels,
                drafter=source,
                draft_policy=DraftLengthPolicy(k),
            )
        )
        assert [t for r in records for t in r.tokens] == plain, (drafter, k)


def transformers_routing(hf, tokens):
    """{decoder layer: expert ids [T, m]} as transformers' routers choose them."""
    chosen = {}

    def keep(layer):
        return lambda module, args, out: chosen.__setitem__(layer, out[2])

    routers = [
        getattr(layer.mlp, "router", None) or getattr(layer.mlp, "gate", None)
        for layer in hf.model.layers
    ]
    hooks = [r.register_forward_hook(keep(i)) for i, r in enumerate(routers)]
    with torch.no_grad():
        hf(tokens)
    for hook in hooks:
        hook.remove()
    return chosen


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_the_routing_sink_sees_the_experts_transformers_chooses(checkpoint_dir, architecture):
    directory, hf = checkpoint_dir(architecture)
    model, _ = load_model(directory, dtype="fp32")
    seen = {}
    model(TOKENS, model.new_cache(), routing_sink=lambda i, ids, w: seen.__setitem__(i, (ids, w)))
    expected = transformers_routing(hf, TOKENS)
    assert sorted(seen) == sorted(expected) == list(range(hf.config.num_hidden_layers))
    for layer, (ids, weights) in seen.items():
        assert torch.equal(ids.sort().values, expected[layer].sort().values)
        assert torch.allclose(weights.sum(-1), torch.ones(len(ids)))


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_trace_records_the_routing_of_the_tiny_checkpoint(
    checkpoint_dir, architecture, tmp_path, capsys
):
    directory, _ = checkpoint_dir(architecture)
    corpus = tmp_path / "doc.txt"
    corpus.write_text(" ".join(f"w{i % 90}" for i in range(40)))
    out = tmp_path / "trace.parquet"
    code = main(["trace", "--model", str(directory), "--corpus", str(corpus), "--out", str(out)])
    assert code == 0 and f"wrote {out}: 1 documents, 40 tokens" in capsys.readouterr().out
    trace = read_trace(out)
    layers = load_model(directory)[0].config.num_layers
    assert (trace.num_layers, trace.num_experts, trace.top_k) == (layers, 8, 2)


# gpt-oss only: a plan's fixed costs (the read-bandwidth probe, the held-out corpus, the
# report) are ~10 s whatever the model, and MiniMax-M2 differs from it in nothing plan reads
# beyond what the routing and kernel tests above check.
@pytest.mark.parametrize("architecture", ["gpt_oss"])
def test_plan_calibrates_the_tiny_checkpoint(checkpoint_dir, architecture, tmp_path):
    import json
    import shutil

    from tests.checkpoints import write_text_tokenizer

    directory = tmp_path / "model"
    shutil.copytree(checkpoint_dir(architecture)[0], directory)
    write_text_tokenizer(directory, 96)  # plan records routing from text
    out = tmp_path / "plan"
    code = main(
        ["plan", "--model", str(directory), "--out", str(out), "--dtype", "fp32",
         "--max-n", "3", "--repeats", "1", "--windows", "2", "--flush-mib", "0",
         "--verify-repeats", "1", "--verify-seconds", "0", "--json"]
    )  # fmt: skip
    assert code == 0
    plan = json.loads((out / "plan.json").read_text())
    settings = plan["provenance"]["settings"]  # 0: no time budget, every round timed
    assert settings["verify_seconds"] is None and settings["verify_rounds"] == 1
    assert plan["model"]["model_type"] == architecture and len(plan["verify_time"]) == 3
    assert plan["kernel"]["crossover"] is None or plan["kernel"]["crossover"] >= 1


@pytest.mark.parametrize("kernel", ["slot", "dedup"])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_bf16_speculation_on_a_batch_invariant_target_equals_plain_greedy(
    checkpoint_dir, architecture, kernel
):
    # As `moespec generate` runs it: sinks, windows, biases and clamps all row by row.
    target, _ = load_model(checkpoint_dir(architecture)[0], dtype="bf16")
    target.batch_invariant = True
    kernels = KernelPolicy(kernel)
    prompt = PROMPT * 2
    plain = [t for r in generate(target, prompt, max_tokens=24, kernels=kernels) for t in r.tokens]
    reference = greedy_reference(target, prompt, 24)
    for k in (2, 5, 8):
        drafter = OracleDrafter(reference, len(prompt), 0.6, target.config.vocab_size, seed=1)
        records = generate(
            target,
            prompt,
            max_tokens=24,
            kernels=kernels,
            drafter=drafter,
            draft_policy=DraftLengthPolicy(k),
        )
        assert [t for r in records for t in r.tokens] == plain, k
