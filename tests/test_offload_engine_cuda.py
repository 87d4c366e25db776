"""The CUDA backend's ordering, exercised without a GPU: streams and events are stand-ins that
log what waits on what, the tensors stay on the CPU. A kernel must wait for its expert's copy;
a copy into a reused slot must wait for the last kernel that read the slot. A store in the
native pair layout fills plain slots, as the device kernels read them."""

import contextlib
import itertools
import threading

import pytest
import torch

from moespec.decoding import DraftLengthPolicy, KernelPolicy, OracleDrafter, generate
from moespec.kernels.cpu import cpu_paths
from moespec.models import load_model
from moespec.offload import make_policy
from moespec.offload.engine.executor import OffloadEngine
from moespec.offload.engine.tiers import CudaBackend, keeps_packed_experts

PROMPT = [5, 17, 33, 2, 5, 17, 40, 41]


class Log:
    def __init__(self):
        self.entries, self.lock, self.ids = [], threading.Lock(), itertools.count()

    def add(self, *entry):
        with self.lock:
            self.entries.append(entry)


class FakeEvent:
    def __init__(self, log, enable_timing=False):
        self.log, self.id, self.stream = log, next(log.ids), None

    def record(self, stream):
        self.stream = stream.name
        self.log.add("record", stream.name, self.id)

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return 0.0


class FakeStream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_event(self, event):
        self.log.add("wait", self.name, event.id)


class LoggedCudaBackend(CudaBackend):
    """Logs which slot each copy fills and which slots each kernel read, with the events."""

    def copy(self, pool, job, source):
        guard = self.last_use.get(job.slot)
        self.log.add("copy", job.slot, None if guard is None else guard.id)
        super().copy(pool, job, source)

    def used(self, slots):
        super().used(slots)
        for slot in slots:
            self.log.add("used", int(slot), self.last_use[int(slot)].id)


def offloaded_tokens(model, engine, reference, kernels) -> list[int]:
    """The greedy tokens of an oracle-drafted (k = 3) run through `engine`, as long as
    `reference`."""
    drafter = OracleDrafter(reference, len(PROMPT), 0.6, model.config.vocab_size, seed=1)
    records = generate(
        model,
        PROMPT,
        max_tokens=len(reference),
        kernels=kernels,
        offload=engine,
        drafter=drafter,
        draft_policy=DraftLengthPolicy(3),
    )
    return [t for r in records for t in r.tokens]


@pytest.fixture(scope="module")
def model(checkpoint_dir):
    """Loaded (and transformers imported, by the checkpoint) before torch.cuda is faked."""
    return load_model(checkpoint_dir("qwen3_moe")[0], dtype="fp32")[0]


@pytest.fixture
def fake_cuda(monkeypatch):
    log = Log()
    compute = FakeStream(log, "compute")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream(log, "copy"))
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: FakeEvent(log))
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self.clone())
    return log


def test_cuda_ordering_of_copies_and_kernels(model, fake_cuda):
    kernels = KernelPolicy("slot")
    reference = [
        t for r in generate(model, PROMPT, max_tokens=16, kernels=kernels) for t in r.tokens
    ]
    backend = LoggedCudaBackend("cpu")  # the device's tensors live on the CPU here
    backend.log = fake_cuda
    w = next(iter(model.moe_blocks.values())).experts.bytes_per_expert
    with OffloadEngine.for_model(
        model, make_policy("lru"), 3 * w, draft_length=3, device=backend
    ) as engine:
        assert offloaded_tokens(model, engine, reference, kernels) == reference

    recorded_on = {}  # event id -> stream it was recorded on
    last_reader = {}  # slot -> event after the last kernel that read it
    guarded = 0
    for entry in fake_cuda.entries:
        kind = entry[0]
        if kind == "record":
            recorded_on[entry[2]] = entry[1]
        elif kind == "wait" and entry[1] == "compute":  # a kernel waits for a copy
            assert recorded_on.get(entry[2]) == "copy"
        elif kind == "used":
            last_reader[entry[1]] = entry[2]
        elif kind == "copy":
            slot, guard = entry[1], entry[2]
            assert guard == last_reader.pop(slot, None)  # the slot's last reader, if any
            guarded += guard is not None
    waits_on_copy_stream = [e[2] for e in fake_cuda.entries if e[:2] == ("wait", "copy")]
    assert guarded > 0 and len(waits_on_copy_stream) == guarded
    assert all(recorded_on[event] == "compute" for event in waits_on_copy_stream)


@pytest.mark.skipif(
    cpu_paths().bf16 != "native-pairs",
    reason=f"bf16 runs {cpu_paths().bf16} here, not the native pair layout the store would hold",
)
def test_a_pair_layout_store_fills_plain_device_slots(checkpoint_dir, fake_cuda):
    # The CPU tier computes from the store in the native pair layout; the copies move those
    # bytes and lay them out plain where they land, as the device kernels read them.
    packed = load_model(checkpoint_dir("qwen3_moe")[0], dtype="bf16")[0]
    assert keeps_packed_experts("cuda", torch.bfloat16)
    kernels = KernelPolicy("slot")
    reference = [
        t for r in generate(packed, PROMPT, max_tokens=12, kernels=kernels) for t in r.tokens
    ]
    backend = LoggedCudaBackend("cpu")
    backend.log = fake_cuda
    experts = next(iter(packed.moe_blocks.values())).experts
    budget = len(packed.moe_blocks) * experts.num_experts * experts.bytes_per_expert // 4
    with OffloadEngine.for_model(
        packed, make_policy("spac"), budget, draft_length=3, device=backend
    ) as engine:
        assert offloaded_tokens(packed, engine, reference, kernels) == reference
        assert engine.store.layers[0].is_packed and not engine.pool.weights.is_packed
        present = engine.cache.present.nonzero()
        assert len(present[0]) > 0
        for layer, expert in zip(*present, strict=True):
            slot = engine.slot_of[layer, expert]
            gate_up, down = engine.store.layers[layer].dense_weights(expert)
            assert torch.equal(engine.pool.weights.gate_up[slot], gate_up)
            assert torch.equal(engine.pool.weights.down[slot], down)


@pytest.mark.parametrize("shape", [(128, 64), (70, 33)], ids=["whole-groups", "padded"])
def test_a_pair_layout_weight_lands_plain_where_it_is_copied(shape):
    # What a CUDA copy does on the device: the pair-layout bytes laid out as [out, in] again.
    from moespec.kernels.native import pack_pairs, unpack_pairs_into

    weight = torch.randn(shape).to(torch.bfloat16)
    out = torch.empty(shape, dtype=torch.bfloat16)
    unpack_pairs_into(out, pack_pairs(weight))
    assert torch.equal(out, weight)
