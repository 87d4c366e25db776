"""The offload engine on a bf16 checkpoint packed as a user's CPU run holds it: the store and
the slots in the native pair layout, copies moving those bytes, the same tokens as the packed
model in memory, and layouts the tiers cannot copy refused with the reason."""

import pytest
import torch

from moespec.decoding import DraftLengthPolicy, KernelPolicy, OracleDrafter, generate
from moespec.kernels.cpu import cpu_paths
from moespec.kernels.native import PairWeight
from moespec.models import load_model
from moespec.offload import make_policy
from moespec.offload.engine.executor import OffloadEngine
from moespec.offload.engine.tiers import CpuBackend, ExpertStore, keeps_packed_experts

pytestmark = pytest.mark.skipif(
    cpu_paths().bf16 != "native-pairs",
    reason=f"bf16 runs {cpu_paths().bf16} here, not the native pair layout the tiers copy",
)

PROMPT = [5, 17, 33, 2, 5, 17, 40, 41]
TOKENS = 16


@pytest.fixture(scope="module")
def model(checkpoint_dir):
    return load_model(checkpoint_dir("qwen3_moe")[0], dtype="bf16")[0]


def tokens_of(records):
    return [t for r in records for t in r.tokens]


@pytest.fixture(scope="module")
def reference(model):
    return tokens_of(generate(model, PROMPT, max_tokens=TOKENS, kernels=KernelPolicy("slot")))


def quarter_budget(model) -> int:
    experts = next(iter(model.moe_blocks.values())).experts
    return len(model.moe_blocks) * experts.num_experts * experts.bytes_per_expert // 4


def test_the_model_loads_with_its_experts_in_the_pair_layout(model):
    assert keeps_packed_experts("cpu", torch.bfloat16)
    for block in model.moe_blocks.values():
        assert all(isinstance(w, PairWeight) for w in block.experts.packed_gate_up)


@pytest.mark.parametrize("policy", ["spac", "lru", "static", "hybrid"])
def test_offloaded_packed_experts_give_the_in_memory_tokens(model, reference, policy):
    engine = OffloadEngine.for_model(
        model, make_policy(policy), quarter_budget(model), draft_length=3
    )
    drafter = OracleDrafter(reference, len(PROMPT), 0.6, model.config.vocab_size, seed=1)
    with engine:
        records = generate(
            model,
            PROMPT,
            max_tokens=TOKENS,
            kernels=KernelPolicy("slot"),
            offload=engine,
            drafter=drafter,
            draft_policy=DraftLengthPolicy(3),
        )
        assert tokens_of(records) == reference
        stats = engine.summary()
    assert stats["bytes_copied"] > 0 or stats["cpu_experts"] > 0  # the tiers were exercised
    # every cached expert's slot holds that expert's packed bytes
    assert all(isinstance(w, PairWeight) for w in engine.pool.weights.packed_gate_up)
    present = engine.cache.present.nonzero()
    assert len(present[0]) > 0
    for layer, expert in zip(*present, strict=True):
        slot, store = engine.slot_of[layer, expert], engine.store.layers[layer]
        assert torch.equal(
            engine.pool.weights.packed_gate_up[slot].packed, store.packed_gate_up[expert].packed
        )
        assert torch.equal(
            engine.pool.weights.packed_down[slot].packed, store.packed_down[expert].packed
        )


def test_a_pass_from_packed_slots_is_bit_for_bit_the_in_memory_pass(model):
    experts = next(iter(model.moe_blocks.values())).experts
    layers = len(model.moe_blocks)
    budget = 6 * layers * experts.bytes_per_expert
    engine = OffloadEngine.for_model(model, make_policy("lru"), budget)
    memory, offloaded = model.new_cache(capacity=32), model.new_cache(capacity=32)
    prompt, step = torch.tensor(PROMPT), torch.tensor([7, 9, 11])
    model.native = False  # an offloaded pass is eager: the in-memory one here too
    try:
        with engine:
            model(prompt, memory)
            engine.begin_step(len(PROMPT), prefill=True)
            model(prompt, offloaded, offload=engine)
            engine.end_step(0)
            engine.take_stats()
            engine.begin_step(len(step))
            got = model(step, offloaded, all_logits=True, offload=engine)
            engine.end_step(0)
            assert engine.take_stats()["cpu_experts"] == 0  # all from the slots
        assert torch.equal(got, model(step, memory, all_logits=True))
    finally:
        model.native = True


def test_a_layout_the_tiers_cannot_copy_is_refused_with_the_reason(checkpoint_dir):
    model = load_model(checkpoint_dir("qwen3_moe")[0], dtype="bf16", weights="int8-experts")[0]
    layers = [block.experts for block in model.moe_blocks.values()]
    with pytest.raises(ValueError, match="MoE layer 0: the experts are held as Int8Weight"):
        ExpertStore(layers, CpuBackend())


def test_the_simulator_probes_the_cpu_tier_in_the_engines_layout():
    from moespec.offload.sim.hardware import _store_of_experts

    probe = _store_of_experts(256, 128, 1 << 20, dtype=torch.bfloat16, packed=True)
    assert all(isinstance(w, PairWeight) for w in probe.packed_gate_up + probe.packed_down)
    assert not _store_of_experts(256, 128, 1 << 20, dtype=torch.bfloat16).is_packed
