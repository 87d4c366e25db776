"""The routing replay: every pass's experts are the trace's at the pass's positions (prompt
chunks, plain steps, verification passes after rejected drafts), and the offloaded replay
decodes the in-memory replay's greedy tokens."""

import numpy as np
import pytest
import torch

from moespec.decoding import DraftLengthPolicy, KernelPolicy, OracleDrafter, generate
from moespec.models import load_model
from moespec.models.converted import convert
from moespec.offload import make_policy
from moespec.offload.engine.disk import DiskStore
from moespec.offload.engine.executor import OffloadEngine
from moespec.offload.engine.replay import RoutingReplay
from moespec.routing.synthetic import LocalityProcess

PROMPT = [5, 17, 33, 2, 5, 17, 40, 41]
TOKENS = 12


@pytest.fixture(scope="module")
def model(checkpoint_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("replay") / "int8"
    convert(checkpoint_dir("qwen3_moe")[0], out, weights="int8")
    return load_model(out, pack_experts=False)[0]


def trace_ids(model, tokens: int, seed: int = 0) -> np.ndarray:
    """[tokens, L, m] of a process with locality, on the model's shape."""
    block = next(iter(model.moe_blocks.values()))
    process = LocalityProcess(block.experts.num_experts, block.top_k, keep_probability=0.6)
    return next(process.documents(len(model.moe_blocks), [tokens], seed)).astype(np.int64)


class Recorder:
    """An inner executor that records each pass's ids of the first MoE layer."""

    def __init__(self, model):
        self.first = min(model.moe_blocks)
        self.passes = []

    def begin_step(self, n_tokens, **step):
        pass

    def end_step(self, accepted):
        pass

    def take_stats(self):
        return {}

    def __call__(self, layer, x, expert_ids, expert_weights, kernel):
        if layer == self.first:
            self.passes.append(expert_ids.clone())
        return torch.zeros_like(x)


def decode(model, offload, reference=None, draft_length=0):
    extra = {}
    if draft_length:
        drafter = OracleDrafter(reference, len(PROMPT), 0.5, model.config.vocab_size, seed=3)
        extra = dict(drafter=drafter, draft_policy=DraftLengthPolicy(draft_length))
    records = list(
        generate(
            model, PROMPT, max_tokens=TOKENS, kernels=KernelPolicy("slot"), offload=offload, **extra
        )
    )
    return [t for r in records for t in r.tokens], records


@pytest.mark.parametrize("draft_length", [0, 3])
def test_each_pass_runs_the_trace_experts_of_its_positions(model, draft_length):
    ids = trace_ids(model, len(PROMPT) + TOKENS + draft_length + 1)
    recorder = Recorder(model)
    replay = RoutingReplay(ids, sorted(model.moe_blocks), recorder)
    tokens, records = decode(model, replay)
    if draft_length:  # the oracle re-proposes the plain run's tokens, some of them wrong
        recorder.passes.clear()
        replay = RoutingReplay(ids, sorted(model.moe_blocks), recorder)
        _, records = decode(model, replay, tokens, draft_length)
    assert any(r.accepted < r.drafted for r in records) or not draft_length
    position, passes = len(PROMPT), iter(recorder.passes)
    assert torch.equal(next(passes), torch.from_numpy(ids[: len(PROMPT), 0]))
    for record in records[1:]:
        forced = next(passes)
        assert torch.equal(forced, torch.from_numpy(ids[position : position + record.n_tokens, 0]))
        position += record.accepted + 1
    assert next(passes, None) is None


def test_the_disk_tier_replay_decodes_the_in_memory_replay_tokens(model):
    ids = trace_ids(model, len(PROMPT) + TOKENS + 4)
    layers = sorted(model.moe_blocks)
    reference, _ = decode(model, RoutingReplay(ids, layers, experts=model))
    own, _ = decode(model, None)
    assert reference != own  # the replay changed what the experts computed
    store = DiskStore.for_model(model)
    engine = OffloadEngine.for_model(
        model, make_policy("spac"), store.total_bytes // 3, draft_length=3, store=store
    )
    with engine:
        replayed, _ = decode(model, RoutingReplay(ids, layers, engine), reference, 3)
    assert replayed == reference


def test_a_pass_beyond_the_trace_is_refused(model):
    replay = RoutingReplay(trace_ids(model, 4), sorted(model.moe_blocks), experts=model)
    with pytest.raises(ValueError, match="holds 4 positions"):
        decode(model, replay)
