"""The disk tier on tiny converted checkpoints: the in-memory greedy tokens from experts read
out of the converted file into a third of their bytes, and every fault a one-line error naming
the file and the expert (bytes that changed, a file that changed or shrank, a budget too small),
with nothing half-read ever used and close() prompt while reads are queued."""

import os
import shutil
import threading
import time

import pytest
import torch

from moespec.decoding import DraftLengthPolicy, KernelPolicy, OracleDrafter, generate
from moespec.errors import SettingError
from moespec.models import load_model
from moespec.models.converted import WEIGHTS_FILE
from moespec.offload import make_policy
from moespec.offload.engine import disk
from moespec.offload.engine.disk import DiskStore, DiskTierError, disk_budget
from moespec.offload.engine.executor import OffloadEngine
from moespec.offload.engine.tiers import CopyJob, Link

PROMPT = [5, 17, 33, 2, 5, 17, 40, 41]
TOKENS = 16
DRAFT_LENGTH = 3


@pytest.fixture
def own_copy(converted, tmp_path):
    """A converted directory of this test's own, to change under a store."""

    def make(weights: str):
        out = tmp_path / weights
        shutil.copytree(converted(weights), out)
        return out

    return make


def tokens_of(records):
    return [t for r in records for t in r.tokens]


def load(directory):
    model = load_model(directory, pack_experts=False)[0]
    model.batch_invariant = True  # as `moespec generate` decodes: verify rows = one-token rows
    return model


def decode(model, engine=None, *, reference=None):
    """Greedy tokens, speculating with an oracle drafter when the engine plans for drafts."""
    extra = {}
    if engine is not None and engine.draft_length:
        vocab = model.config.vocab_size
        extra = dict(
            drafter=OracleDrafter(reference, len(PROMPT), 0.6, vocab, seed=1),
            draft_policy=DraftLengthPolicy(engine.draft_length),
        )
    records = generate(
        model, PROMPT, max_tokens=TOKENS, kernels=KernelPolicy("slot"), offload=engine, **extra
    )
    return tokens_of(records)


def disk_engine(model, policy: str, draft_length: int = 0, share: float = 1 / 3):
    store = DiskStore.for_model(model)
    budget = int(share * store.total_bytes)
    return OffloadEngine.for_model(
        model, make_policy(policy), budget, draft_length=draft_length, store=store
    )


@pytest.mark.parametrize(
    "weights, policy, draft_length",
    [
        ("fp32", "lru-ar", 0),
        ("fp32", "spac", DRAFT_LENGTH),
        ("bf16", "spac", DRAFT_LENGTH),
        ("int8", "lru", DRAFT_LENGTH),
    ],
)
def test_experts_read_from_disk_decode_the_in_memory_greedy_tokens(
    converted, weights, policy, draft_length
):
    model = load(converted(weights))
    reference = decode(model)
    with disk_engine(model, policy, draft_length) as engine:
        assert decode(model, engine, reference=reference) == reference
    summary = engine.summary()
    assert summary["device"] == "disk" and summary["slots"] < engine.store.num_layers * 8 / 2
    assert engine.cache.peak_bytes <= engine.budget_bytes
    assert summary["misses"] > 0 and summary["experts_read"] >= summary["misses"]
    # every expert read is its runs' aligned pages: its bytes at least, a slot's at most
    layout, reads = engine.store.layout, summary["experts_read"]
    assert reads * layout.expert_bytes <= summary["disk_bytes_read"] <= reads * layout.stride
    assert summary["stall_seconds"] >= summary["copy_wait_seconds"]


def test_without_direct_io_the_tier_reads_buffered_and_decodes_the_same(converted, monkeypatch):
    model = load(converted("fp32"))
    reference = decode(model)
    monkeypatch.delattr(os, "O_DIRECT", raising=False)
    with disk_engine(model, "lru-ar") as engine:
        assert decode(model, engine) == reference
    assert engine.summary()["o_direct"] is False


def first_expert_range(store, l: int, e: int) -> tuple[int, int]:
    """(file offset, bytes) of expert e's first tensor in layer l."""
    file_start, _, offset, _ = store.layout.runs[l][e][0]
    place = store.layout.places[l][e][0]
    dtype, shape = store.layout.specs[0]
    return file_start + place - offset, disk._nbytes(dtype, shape)


def rewrite_in_place(path, offset: int, nbytes: int, *, keep_mtime: bool) -> None:
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(nbytes)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in old))
    if keep_mtime:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_an_expert_whose_bytes_changed_after_its_first_read_is_a_clear_error(own_copy):
    directory = own_copy("fp32")
    store = DiskStore.for_model(load(directory))
    pool = store.slot_pool(2)
    store.read(0, 3, pool, 0)
    pool.release(0)  # evicted
    rewrite_in_place(directory / WEIGHTS_FILE, *first_expert_range(store, 0, 3), keep_mtime=True)
    with pytest.raises(DiskTierError, match=r"expert 3 of layer 0 read other bytes") as error:
        store.read(0, 3, pool, 0)
    assert str(directory / WEIGHTS_FILE) in str(error.value)
    assert pool.weights.packed_gate_up[0] is None  # nothing of the failed read is used
    store.close()


def test_a_file_modified_under_the_store_is_refused_naming_it(own_copy):
    directory = own_copy("fp32")
    store = DiskStore.for_model(load(directory))
    pool = store.slot_pool(1)
    rewrite_in_place(directory / WEIGHTS_FILE, *first_expert_range(store, 1, 5), keep_mtime=False)
    with pytest.raises(DiskTierError, match=r"changed while in use.*expert 2 of layer"):
        store.read(1, 2, pool, 0)
    store.close()


def test_a_truncated_file_is_a_read_error_naming_the_file_offset_and_expert(own_copy):
    directory = own_copy("int8")
    store = DiskStore.for_model(load(directory))
    # the expert whose bytes end last in the file, cut short
    l, e = max(
        ((l, e) for l in range(store.num_layers) for e in range(store.num_experts)),
        key=lambda le: max(r[0] + r[3] for r in store.layout.runs[le[0]][le[1]]),
    )
    end = max(r[0] + r[3] for r in store.layout.runs[l][e])
    os.truncate(directory / WEIGHTS_FILE, end - 100)
    pool = store.slot_pool(1)
    layer = store.layout.layer_indices[l]
    with pytest.raises(
        DiskTierError,
        match=rf"ended at byte \d+ while reading expert {e} of "
        rf"layer {layer} .*truncated",
    ) as error:
        store.read(l, e, pool, 0)
    assert str(directory / WEIGHTS_FILE) in str(error.value)
    assert pool.weights.packed_gate_up[0] is None
    store.close()


def test_a_budget_below_one_layers_active_experts_is_refused_with_the_minimum(converted):
    model = load(converted("fp32"))
    least = DiskStore.for_model(model).layout.least_budget
    with pytest.raises(SettingError, match=rf"the least is {least} bytes") as error:
        disk_budget(model, least - 1, available=1 << 40)
    assert "memory_budget=" in str(error.value)
    assert disk_budget(model, least, available=1 << 40) == (least, None)


def test_a_budget_above_available_memory_is_capped_with_a_warning(converted):
    model = load(converted("fp32"))
    layout = disk.DiskLayout(model)
    available = layout.dense_bytes + disk.MARGIN + 10 * layout.stride
    budget, note = disk_budget(model, "1G", available=available)
    assert budget == 10 * layout.stride and note.startswith("warning:")
    auto, note = disk_budget(model, None, available=available)
    assert auto == budget and "available memory less the dense weights" in note
    with pytest.raises(SettingError, match="a size such as 6G"):
        disk_budget(model, "lots", available=available)


def test_sizes_read_in_binary_units():
    assert disk.parse_size("6G") == 6 << 30
    assert disk.parse_size("512M") == 512 << 20
    assert disk.parse_size("1.5GiB") == 3 << 29
    assert disk.parse_size("4096") == 4096


def test_close_returns_promptly_with_prefetches_queued_and_stops_every_reader(converted):
    model = load(converted("fp32"))
    store = DiskStore.for_model(model)
    pool = store.slot_pool(8)
    arrived = []
    pulled = [0]

    def pull():  # an endless queue of prefetches
        pulled[0] += 1
        n = pulled[0]
        return CopyJob(n % store.num_layers, n % store.num_experts, n % pool.slots, "prefetch")

    lock = threading.Condition()
    link = Link(pool, store, store.backend, lock, pull, arrived.append)
    while len(arrived) < 20:  # reads are in flight
        with lock:
            lock.wait(0.01)
    start = time.perf_counter()
    link.close()
    store.close()
    assert time.perf_counter() - start < 2.0
    assert not any(thread.is_alive() for thread in link.threads)
    assert len(link.threads) == disk.IO_THREADS and link.error is None


class SlowDisk:
    """The store's own backend, each read held for `delay` seconds (a disk slower than this
    one, so that reads in flight overlap by a known amount)."""

    def __init__(self, backend, delay: float):
        self.backend, self.delay, self.link_threads = backend, delay, 2

    def copy(self, pool, job, layer):
        time.sleep(self.delay)
        self.backend.copy(pool, job, layer)


def test_the_links_busy_time_counts_overlapping_reads_once(converted):
    model = load(converted("fp32"))
    store = DiskStore.for_model(model)
    pool = store.slot_pool(4)
    lock, arrived = threading.Condition(), []
    jobs = [CopyJob(0, e, e, "fetch") for e in range(4)]
    link = Link(pool, store, SlowDisk(store.backend, 0.2), lock, lambda: None, arrived.append)
    try:
        with lock:
            link.take_busy()
            start = time.perf_counter()
            link.fetches.extend(jobs)  # two reads in flight, twice over
            lock.notify_all()
        while len(arrived) < len(jobs):
            with lock:
                lock.wait(0.01)
        with lock:
            wall, busy = time.perf_counter() - start, link.take_busy()
            assert link.take_busy() < 0.01  # counted once
    finally:
        link.close()
        store.close()
    own = sum(job.seconds for job in jobs)
    assert own >= 0.8  # each read's own duration: four reads of 0.2 s
    assert 0.4 <= busy <= wall  # the link: two rounds of two overlapping reads
    assert busy < 0.75 * own


def test_the_disk_tier_refuses_a_model_that_was_not_converted(checkpoint_dir):
    model = load_model(checkpoint_dir("qwen3_moe")[0], dtype="fp32")[0]
    with pytest.raises(ValueError, match="moespec convert"):
        DiskStore.for_model(model)


def test_slot_weights_are_the_experts_bytes_from_the_file(converted):
    model = load(converted("int8"))
    store = DiskStore.for_model(model)
    pool = store.slot_pool(3)
    block = model.moe_blocks[store.layout.layer_indices[1]]
    for slot, e in enumerate([7, 0, 4]):
        store.read(1, e, pool, slot)
        for ours, theirs in zip(pool.weights.weights(slot), block.experts.weights(e), strict=True):
            assert torch.equal(ours.scales, theirs.scales)
            assert torch.equal(
                ours.pairs if ours.values is None else ours.values,
                theirs.pairs if theirs.values is None else theirs.values,
            )
    store.close()
