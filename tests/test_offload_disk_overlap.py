"""The disk tier's reads overlapped with compute: a layer's cached experts are computed while
its misses are read, each expert's runs read in page chunks in parallel; the greedy tokens
stay the in-memory ones, the stall counts only the wait for what had not arrived, and faults
and interruptions mid-read stay one-line errors that leave no thread behind."""

import os
import threading

import numpy as np
import pytest
import torch

from moespec.decoding import DraftLengthPolicy, KernelPolicy, OracleDrafter, generate
from moespec.kernels import get_kernel
from moespec.models import load_model
from moespec.models.converted import WEIGHTS_FILE
from moespec.offload import make_policy
from moespec.offload.engine import disk, executor
from moespec.offload.engine.disk import DiskStore, DiskTierError
from moespec.offload.engine.executor import OffloadEngine

PROMPT = [5, 17, 33, 2, 5, 17, 40, 41]
TOKENS = 16
CHUNKED = dict(chunk_bytes=disk.PAGE, read_depth=4)  # every run of a tiny expert in pieces


def load(directory):
    model = load_model(directory, pack_experts=False)[0]
    model.batch_invariant = True
    return model


def decode(model, engine=None, reference=None):
    extra = {}
    if engine is not None and engine.draft_length:
        extra = dict(
            drafter=OracleDrafter(reference, len(PROMPT), 0.6, model.config.vocab_size, seed=1),
            draft_policy=DraftLengthPolicy(engine.draft_length),
        )
    records = generate(
        model, PROMPT, max_tokens=TOKENS, kernels=KernelPolicy("slot"), offload=engine, **extra
    )
    return [t for r in records for t in r.tokens]


def disk_engine(model, policy="lru", draft_length=0, share=1 / 3, **store_options):
    store = DiskStore.for_model(model, **store_options)
    return OffloadEngine.for_model(
        model, make_policy(policy), int(share * store.total_bytes), draft_length=draft_length,
        store=store,
    )  # fmt: skip


@pytest.mark.parametrize(
    "weights, policy, draft_length",
    [("fp32", "lru", 0), ("bf16", "spac", 3), ("int8", "lru", 3), ("int8", "static", 0)],
)
def test_chunked_reads_computed_on_arrival_decode_the_in_memory_greedy_tokens(
    converted, weights, policy, draft_length
):
    model = load(converted(weights))
    reference = decode(model)
    with disk_engine(model, policy, draft_length, **CHUNKED) as engine:
        assert engine.on_arrival
        assert decode(model, engine, reference) == reference
    summary = engine.summary()
    assert summary["misses"] > 0
    # more calls than experts read: the runs went in page chunks
    assert summary["disk_reads"] > summary["experts_read"] * len(engine.store.layout.runs[0][0])


def test_the_tier_without_overlap_decodes_the_same_tokens(converted):
    model = load(converted("int8"))
    reference = decode(model)
    options = dict(on_arrival=False, read_depth=1, chunk_bytes=1 << 40)
    with disk_engine(model, "lru", 3, **options) as engine:
        assert not engine.on_arrival
        assert decode(model, engine, reference) == reference


class HeldRead:
    """The store's read of one expert held until the kernel has been called (or `release`)."""

    def __init__(self, store, layer: int, expert: int):
        self.store, self.target = store, (layer, expert)
        self.released, self.done = threading.Event(), threading.Event()
        self.released_by_kernel = False
        real = store.read

        def read(l, e, slots, slot):
            if (l, e) == self.target:
                self.released.wait(timeout=10)
                real(l, e, slots, slot)
                self.done.set()
            else:
                real(l, e, slots, slot)

        store.read = read  # what the link's copies call


def one_layer_pass(engine, model, ids: list[int], kernel):
    """y of MoE layer 0 for one token routed to `ids` (equal weights), through the engine."""
    layer = sorted(model.moe_blocks)[0]
    hidden = model.config.hidden_size
    x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(0)).to(model.dtype)
    expert_ids = torch.tensor([ids])
    weights = torch.full((1, len(ids)), 1.0 / len(ids))
    engine.begin_step(1)
    try:
        return engine(layer, x, expert_ids, weights, kernel), (x, expert_ids, weights)
    finally:
        engine.end_step(0)


def engine_holding(model, experts: list[int], **store_options):
    """A started engine whose cache holds `experts` of layer 0 (a pass fetched them)."""
    engine = disk_engine(model, "lru", share=0.5, **store_options)
    engine.start()
    one_layer_pass(engine, model, experts, "slot")
    assert engine.cache.present[0, experts].all()
    return engine


def test_cached_experts_are_computed_while_a_miss_is_read_and_only_the_rest_is_stall(
    converted, monkeypatch
):
    model = load(converted("fp32"))
    block = model.moe_blocks[sorted(model.moe_blocks)[0]]
    engine = engine_holding(model, [0, 1])
    hit, miss = 0, int(np.flatnonzero(~engine.cache.present[0])[0])
    held = HeldRead(engine.store, 0, miss)
    calls = []
    slot_kernel = get_kernel("slot")

    def kernel(x, ids, weights, experts):
        calls.append((held.done.is_set(), ids.flatten().tolist()))
        held.released_by_kernel |= not held.released.is_set()
        held.released.set()  # the miss may complete now
        return slot_kernel(x, ids, weights, experts)

    monkeypatch.setattr(executor, "get_kernel", lambda name: kernel)
    before = engine.driver.stats.copy_wait_seconds
    y, (x, ids, weights) = one_layer_pass(engine, model, [hit, miss], "slot")
    engine.close()
    # the hit ran first, while the miss was still being read; the miss once it had arrived
    assert held.released_by_kernel
    assert calls[0][0] is False and calls[0][1] == [int(engine.slot_of[0, hit])]
    assert calls[-1][0] is True and calls[-1][1] == [int(engine.slot_of[0, miss])]
    assert engine.driver.stats.copy_wait_seconds > before  # the miss was waited for
    reference = slot_kernel(x, ids, weights, block.experts)
    torch.testing.assert_close(y, reference, rtol=1e-6, atol=1e-6)


def test_a_layer_of_hits_waits_for_nothing(converted):
    model = load(converted("fp32"))
    engine = engine_holding(model, [0, 1])
    before = engine.driver.stats.copy_wait_seconds
    one_layer_pass(engine, model, [1, 0], "slot")
    engine.close()
    assert engine.driver.stats.copy_wait_seconds == before


def test_an_interrupt_while_a_miss_is_read_unpins_and_close_leaves_no_thread(
    converted, monkeypatch
):
    model = load(converted("fp32"))
    engine = engine_holding(model, [0, 1], **CHUNKED)
    hit, miss = 0, int(np.flatnonzero(~engine.cache.present[0])[0])
    held = HeldRead(engine.store, 0, miss)

    def interrupted(x, ids, weights, experts):
        raise KeyboardInterrupt

    monkeypatch.setattr(executor, "get_kernel", lambda name: interrupted)
    with pytest.raises(KeyboardInterrupt):
        one_layer_pass(engine, model, [hit, miss], "slot")
    assert not engine.cache.pinned.any()  # nothing computes these experts any more
    held.released.set()  # the read in flight completes; close waits for no other
    engine.close()
    assert not any(thread.is_alive() for thread in engine.link.threads)
    pools = (engine.store._io, engine.store._chunks)
    assert not any(thread.is_alive() for pool in pools for thread in pool._threads)


def test_a_truncated_file_read_in_chunks_is_one_line_naming_the_file_and_expert(
    converted, tmp_path
):
    import shutil

    directory = tmp_path / "int8"
    shutil.copytree(converted("int8"), directory)
    store = DiskStore.for_model(load(directory), **CHUNKED)
    l, e = max(
        ((l, e) for l in range(store.num_layers) for e in range(store.num_experts)),
        key=lambda le: max(r[0] + r[3] for r in store.layout.runs[le[0]][le[1]]),
    )
    start, length, _, _ = max(store.layout.runs[l][e], key=lambda run: run[1])
    assert length > disk.PAGE  # the run is read in several chunks
    os.truncate(directory / WEIGHTS_FILE, start + disk.PAGE + 100)  # in the run's second chunk
    pool = store.slot_pool(1)
    with pytest.raises(
        DiskTierError, match=rf"ended at byte {start + disk.PAGE + 100} while"
    ) as error:
        store.read(l, e, pool, 0)
    assert "\n" not in str(error.value) and str(directory / WEIGHTS_FILE) in str(error.value)
    assert pool.weights.packed_gate_up[0] is None
    store.close()


def test_chunked_reads_fill_slots_with_the_experts_bytes(converted):
    model = load(converted("int8"))
    whole = DiskStore.for_model(model, read_depth=1, chunk_bytes=1 << 40)
    chunked = DiskStore.for_model(model, **CHUNKED)
    pools = whole.slot_pool(1), chunked.slot_pool(1)
    for e in range(whole.num_experts):
        whole.read(1, e, pools[0], 0)
        chunked.read(1, e, pools[1], 0)
        assert bytes(pools[0].view[: whole.layout.stride]) == bytes(
            pools[1].view[: chunked.layout.stride]
        )
    whole.close()
    chunked.close()


def test_the_checksum_moves_with_a_changed_byte_and_with_swapped_pages():
    data = bytearray(np.random.default_rng(0).integers(0, 256, 3 * disk.PAGE + 5, np.uint8))
    first = disk.expert_checksum(memoryview(bytes(data)))
    for change in (lambda d: d.__setitem__(7, d[7] ^ 1), lambda d: d.__setitem__(-1, d[-1] ^ 1)):
        changed = bytearray(data)
        change(changed)
        assert disk.expert_checksum(memoryview(bytes(changed))) != first
    swapped = data[disk.PAGE : 2 * disk.PAGE] + data[: disk.PAGE] + data[2 * disk.PAGE :]
    assert disk.expert_checksum(memoryview(bytes(swapped))) != first
    assert disk.expert_checksum(memoryview(bytes(data))) == first


def test_settings_out_of_range_are_refused(converted):
    model = load(converted("fp32"))
    with pytest.raises(ValueError, match="read_depth"):
        DiskStore.for_model(model, read_depth=0)
    with pytest.raises(ValueError, match="chunk_bytes"):
        DiskStore.for_model(model, chunk_bytes=disk.PAGE + 1)
