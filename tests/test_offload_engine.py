"""The offload engine on tiny fp32 checkpoints: the same tokens as in memory for every policy and
budget, the budget kept, no expert evicted while its layer computes, slots holding their
experts' bytes, and per-step counts that add up."""

import numpy as np
import pytest
import torch

from moespec.decoding import DraftLengthPolicy, KernelPolicy, OracleDrafter, generate, summarize
from moespec.models import load_model
from moespec.offload import POLICY_NAMES, make_policy
from moespec.offload.engine.executor import OffloadEngine, expert_cache_budget, fits_in_memory

PROMPT = [5, 17, 33, 2, 5, 17, 40, 41]
TOKENS = 20
DRAFT_LENGTH = 3


@pytest.fixture(scope="module")
def model(checkpoint_dir):
    return load_model(checkpoint_dir("qwen3_moe")[0], dtype="fp32")[0]


@pytest.fixture(scope="module")
def reference(model):
    """The in-memory greedy continuation (per-slot kernel)."""
    return tokens_of(generate(model, PROMPT, max_tokens=TOKENS, kernels=KernelPolicy("slot")))


def tokens_of(records):
    return [t for r in records for t in r.tokens]


def expert_bytes(model) -> int:
    return next(iter(model.moe_blocks.values())).experts.bytes_per_expert


def budgets(model) -> dict[str, int]:
    layers, w = len(model.moe_blocks), expert_bytes(model)
    total = layers * model.config.num_experts * w
    return {"one-per-layer": layers * w, "25%": total // 4, "60%": int(0.6 * total)}


def run(model, policy, budget, reference, *, speculate, kernel="slot", sink=None, **options):
    """(records, engine) of an offloaded greedy generation, the engine closed."""
    k = DRAFT_LENGTH if speculate else 0
    engine = OffloadEngine.for_model(model, make_policy(policy), budget, draft_length=k, **options)
    extra = {}
    if speculate:
        vocab = model.config.vocab_size
        extra = dict(
            drafter=OracleDrafter(reference, len(PROMPT), 0.6, vocab, seed=1),
            draft_policy=DraftLengthPolicy(k),
        )
    with engine:
        records = list(
            generate(
                model,
                PROMPT,
                max_tokens=TOKENS,
                kernels=KernelPolicy(kernel),
                offload=engine,
                routing_sink=sink,
                **extra,
            )
        )
    return records, engine


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "speculative"])
@pytest.mark.parametrize("budget", ["one-per-layer", "25%", "60%"])
@pytest.mark.parametrize("policy", [*POLICY_NAMES, "spac-release", "spac-link"])
def test_offloaded_greedy_tokens_equal_in_memory(model, reference, policy, budget, speculate):
    records, engine = run(model, policy, budgets(model)[budget], reference, speculate=speculate)
    assert tokens_of(records) == reference
    assert engine.cache.peak_bytes <= engine.budget_bytes
    assert engine.pool.used == engine.cache.present.sum() <= engine.pool.slots


@pytest.mark.parametrize("family", ["olmoe", "mixtral", "deepseek_v2", "glm4_moe"])
def test_other_families_and_the_dedup_kernel_keep_the_tokens(checkpoint_dir, family):
    model = load_model(checkpoint_dir(family)[0], dtype="fp32")[0]
    kernels = KernelPolicy("dedup")
    reference = tokens_of(generate(model, PROMPT, max_tokens=TOKENS, kernels=kernels))
    for policy in ("spac", "hybrid"):
        records, _ = run(
            model, policy, budgets(model)["25%"], reference, speculate=True, kernel="dedup"
        )
        assert tokens_of(records) == reference, policy


def test_a_pass_on_one_tier_is_bit_for_bit_the_in_memory_pass(model):
    # Before start every expert runs on the host; LRU with room for a pass runs all from slots.
    w, layers = expert_bytes(model), len(model.moe_blocks)
    engine = OffloadEngine.for_model(model, make_policy("lru"), 6 * layers * w)
    memory, offloaded = model.new_cache(capacity=32), model.new_cache(capacity=32)
    prompt, step = torch.tensor(PROMPT), torch.tensor([7, 9, 11])
    with engine:
        expected = model(prompt, memory, all_logits=True)
        engine.begin_step(len(PROMPT), prefill=True)
        got = model(prompt, offloaded, all_logits=True, offload=engine)
        engine.end_step(0)
        assert torch.equal(got, expected)
        engine.take_stats()  # the prompt's: it ran on the host
        engine.begin_step(len(step))
        got = model(step, offloaded, all_logits=True, offload=engine)
        engine.end_step(0)
        assert torch.equal(got, model(step, memory, all_logits=True))
        assert engine.take_stats()["cpu_experts"] == 0


def test_a_pass_split_across_tiers_differs_only_by_rounding(model):
    w, layers = expert_bytes(model), len(model.moe_blocks)
    engine = OffloadEngine.for_model(model, make_policy("static"), layers * w)
    memory, offloaded = model.new_cache(capacity=32), model.new_cache(capacity=32)
    prompt, step = torch.tensor(PROMPT), torch.tensor([5, 17, 33, 2])
    with engine:
        model(prompt, memory)
        engine.begin_step(len(PROMPT), prefill=True)
        model(prompt, offloaded, offload=engine)
        engine.end_step(0)
        engine.begin_step(len(step))
        got = model(step, offloaded, all_logits=True, offload=engine)
        engine.end_step(0)
        stats = engine.take_stats()
    assert stats["hits"] > 0 and stats["cpu_experts"] > 0  # both tiers computed
    torch.testing.assert_close(got, model(step, memory, all_logits=True), rtol=0, atol=1e-5)


# SpAc with its threshold fixed: on the CPU engine the full balancer sees both tiers on one
# processor and copies nothing, so it would evict nothing and leave the check unexercised.
@pytest.mark.parametrize("policy", ["spac-static-tau", "lru", "hybrid"])
def test_no_expert_is_evicted_while_its_layer_computes(model, reference, policy):
    one_per_layer = budgets(model)["one-per-layer"]
    _, engine = run(model, policy, one_per_layer, reference, speculate=True, record=True)
    in_use = {}  # layer -> experts pinned now
    evictions = 0
    for event, layer, experts in engine.log:
        pinned = in_use.setdefault(layer, set())
        if event == "pin":
            pinned.update(experts)
        elif event == "unpin":
            pinned.difference_update(experts)
        else:
            assert not pinned & set(experts), (layer, experts, pinned)
            evictions += 1
    assert evictions > 0  # the budget forced evictions: the check was exercised


def test_every_cached_expert_is_computed_from_its_own_bytes(model, reference):
    _, engine = run(model, "spac", budgets(model)["25%"], reference, speculate=True)
    slots = engine.slot_of[engine.cache.present]
    assert len(np.unique(slots)) == len(slots) and (slots >= 0).all()
    for layer, expert in np.argwhere(engine.cache.present):
        slot, store = engine.slot_of[layer, expert], engine.store.layers[layer]
        assert torch.equal(engine.pool.weights.gate_up[slot], store.gate_up[expert])
        assert torch.equal(engine.pool.weights.down[slot], store.down[expert])


def test_step_records_count_every_needed_expert_once(model, reference):
    distinct = []  # per pass: distinct experts summed over the MoE layers
    first_moe = min(model.moe_blocks)

    def sink(layer, ids, weights):
        if layer == first_moe:
            distinct.append(0)
        distinct[-1] += len(torch.unique(ids))

    records, engine = run(
        model, "hybrid", budgets(model)["25%"], reference, speculate=True, sink=sink
    )
    assert [r.hits + r.misses for r in records] == distinct
    assert all(r.cpu_experts <= r.hits + r.misses for r in records)
    assert all(r.bytes_copied % expert_bytes(model) == 0 for r in records)
    summary = summarize(records)
    assert summary["hits"] + summary["misses"] == sum(distinct)
    assert summary["bytes_copied"] == engine.summary()["bytes_copied"]


def test_static_placement_moves_nothing_and_lru_computes_nothing_on_the_cpu(model, reference):
    static, _ = run(model, "static", budgets(model)["25%"], reference, speculate=True)
    assert sum(r.bytes_copied for r in static) == 0
    lru, _ = run(model, "lru", budgets(model)["60%"], reference, speculate=True)
    assert sum(r.cpu_experts for r in lru[1:]) == 0  # after the prompt, which runs on the host


def test_the_prompt_fits_a_policy_nothing_else_fitted(model):
    w, layers = expert_bytes(model), len(model.moe_blocks)
    policy = make_policy("static")
    engine = OffloadEngine.for_model(model, policy, layers * w)
    with engine:
        engine.begin_step(len(PROMPT), prefill=True)
        model(torch.tensor(PROMPT), model.new_cache(capacity=16), offload=engine)
        engine.end_step(0)
        engine.begin_step(1)  # the first decode step starts the engine
        engine.end_step(0)
    top_k = model.config.top_k
    assert (policy.frequencies_.sum(axis=1) == len(PROMPT) * top_k).all()
    hottest = np.unravel_index(np.argmax(policy.frequencies_), policy.frequencies_.shape)
    assert engine.cache.present[hottest]  # preloaded


def test_budget_below_one_expert_is_refused_and_one_holding_all_needs_no_offload(model):
    w, total = expert_bytes(model), len(model.moe_blocks) * model.config.num_experts * 100
    with pytest.raises(ValueError, match=f"holds no expert: one expert is {w} bytes"):
        OffloadEngine.for_model(model, make_policy("lru"), w - 1)
    with pytest.raises(ValueError, match="holds no expert"):
        expert_cache_budget(10 * w, w, ratio=0.01)
    assert expert_cache_budget(10 * w, w, ratio=0.25) == int(2.5 * w)
    assert fits_in_memory(total, total) and not fits_in_memory(total - 1, total)


def test_passes_must_be_bracketed_by_steps(model):
    engine = OffloadEngine.for_model(model, make_policy("lru"), 4 * expert_bytes(model))
    with engine, pytest.raises(RuntimeError, match="begin_step"):
        model(torch.tensor(PROMPT), model.new_cache(capacity=16), offload=engine)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a CPU-only machine")
def test_cuda_device_without_cuda_is_a_clear_error(model):
    with pytest.raises(ValueError, match="CUDA is not available"):
        OffloadEngine.for_model(model, make_policy("lru"), 4 * expert_bytes(model), device="cuda")


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_the_summary_before_the_first_step_reports_nothing_decided(model, policy):
    engine = OffloadEngine.for_model(model, make_policy(policy), 4 * expert_bytes(model))
    with engine:
        summary = engine.summary()  # before any step: SpAc's balancer does not exist yet
    assert summary["policy"] == policy and summary["hits"] == summary["misses"] == 0
    assert summary["hit_rate"] is None
    if policy == "spac":
        assert summary["balancer_choices"] == 0 and summary["mean_tau"] is None
