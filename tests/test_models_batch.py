"""Batched passes (moespec.models.batch): B sequences of different lengths and positions in one
native pass, each with its own cache, each sequence's logits, keys and values bit for bit
those of its own pass; the exact fallback where the native pass does not run; bad batches
refused before any cache is touched. Where `moespec env` says the native pass runs here, a
model it declines fails these tests: they skip only with the machine's own reason."""

import ctypes

import pytest
import torch

from moespec.kernels import native as nat
from moespec.models import load_model
from moespec.models.batch import batch_pass
from moespec.models.native_step import MAX_TOKENS, NativeStep, _Segment
from tests.native import NATIVE_FAMILIES, native_checkpoints, native_model, needs_native_pass

FAMILIES = NATIVE_FAMILIES
VOCAB = 96  # the test checkpoints' vocabulary


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return native_checkpoints(tmp_path_factory)


def prefilled(model, prompts, capacity=256):
    """Two caches per prompt, each fed its prompt alone: (batched ones, solo ones)."""
    pairs = [[model.new_cache(capacity=capacity) for _ in range(2)] for _ in prompts]
    for prompt, caches in zip(prompts, pairs, strict=True):
        for cache in caches:
            model(torch.tensor([prompt]), cache)
    return [a for a, _ in pairs], [b for _, b in pairs]


def solo(model, feeds, caches, kernel, all_logits):
    """Each sequence's pass alone, as the model runs it: [T_b or 1, V] each."""
    return [
        model(torch.tensor([f]), c, kernel=kernel, all_logits=all_logits)[0]
        for f, c in zip(feeds, caches, strict=True)
    ]


def assert_same_caches(batched, alone):
    for a, b in zip(batched, alone, strict=True):
        assert a.length == b.length
        for x, y in zip(a.keys + a.values, b.keys + b.values, strict=True):
            assert torch.equal(x[:, :, : a.length], y[:, :, : b.length])


def random_batch(g, size=None):
    """B sequences (B from 1, 2, 3, 5), their prompts of 1-24 tokens and three rounds of feeds
    of 1-9 tokens each."""
    size = size or (1, 2, 3, 5)[int(torch.randint(0, 4, (), generator=g))]

    def run(low, high):
        n = int(torch.randint(low, high + 1, (), generator=g))
        return torch.randint(0, VOCAB, (n,), generator=g).tolist()

    prompts = [run(1, 24) for _ in range(size)]
    return prompts, [[run(1, 9) for _ in range(size)] for _ in range(3)]


def assert_batched_equals_solo(model, prompts, rounds, kernel, all_logits=True, passes=None):
    batched, alone = prefilled(model, prompts)
    for feeds in rounds:
        before = model.native_step().passes if passes is not None else 0
        together = batch_pass(model, feeds, batched, kernel=kernel, all_logits=all_logits)
        if passes is not None:
            assert model.native_step().passes - before == passes
        expected = solo(model, feeds, alone, kernel, all_logits)
        for b, (x, y) in enumerate(zip(together, expected, strict=True)):
            assert x.dtype == torch.float32 and x.shape == y.shape, b
            assert torch.equal(x, y), b
        assert_same_caches(batched, alone)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("kernel", ["slot", "dedup"])
def test_each_sequence_of_a_batched_pass_gets_the_bits_of_its_own_pass(checkpoints, family, kernel):
    model = native_model(checkpoints(family))
    g = torch.Generator().manual_seed(len(family) + (kernel == "dedup"))
    for size in (1, 2, 3, 5, None):
        prompts, rounds = random_batch(g, size)
        for all_logits in (True, False):
            # one native pass a round, whatever the batch
            assert_batched_equals_solo(model, prompts, rounds, kernel, all_logits, passes=1)


def test_sequences_that_share_tokens_and_experts_keep_their_own_bits(checkpoints):
    # rows of several sequences routed to the same experts: the deduplicating order gathers
    # them into one product, which must leave every row its own bits
    model = native_model(checkpoints("qwen3_moe"))
    prompts = [[5, 6, 7], [5, 6, 7], [9] * 11, [1]]
    rounds = [[[3, 3, 3], [3], [3, 3], [3] * 9], [[4], [4], [4], [4]]]
    for kernel in ("slot", "dedup"):
        assert_batched_equals_solo(model, prompts, rounds, kernel)


def test_the_avx2_loops_batch_with_the_same_bits(checkpoints):
    needs_native_pass("avx2")
    model = native_model(checkpoints("qwen3_moe"))
    avx2 = NativeStep(model, family="avx2")
    g = torch.Generator().manual_seed(7)
    prompts, rounds = random_batch(g, 5)
    batched, alone = prefilled(model, prompts)
    for kernel, feeds in zip(("slot", "dedup", "dedup"), rounds, strict=True):
        feeds = [torch.tensor(f) for f in feeds]
        together = avx2.batch(feeds, batched, kernel=kernel, all_logits=True)
        for f, cache, x in zip(feeds, alone, together, strict=True):
            assert torch.equal(x, avx2(f[None], cache, kernel="slot", all_logits=True)[0])
        assert_same_caches(batched, alone)


@pytest.mark.parametrize("family", ["this", "avx2"])
def test_the_demo_targets_batched_decode_step_is_each_sequences_own_step(family):
    from moespec.demo import demo_paths
    from moespec.kernels.isa import this_cpu

    needs_native_pass(None if family == "this" else family)
    model = load_model(demo_paths()[0])[0]
    assert model.native_report() == {"native": True, "note": None}
    step = NativeStep(model, family=this_cpu()[2] if family == "this" else family)
    g = torch.Generator().manual_seed(11)
    # a sequence past the rotary tables' first 256 positions: they grow for the batch
    lengths = (64, 3, 130, 17, 1, 40, 254, 8)
    caches = [[model.new_cache(capacity=64) for _ in range(2)] for _ in lengths]
    for n, pair in zip(lengths, caches, strict=True):
        prompt = torch.randint(0, 4096, (1, n), generator=g)
        for cache in pair:
            step(prompt, cache, kernel="slot", all_logits=False)
    for kernel, width in (("slot", 1), ("dedup", 1), ("dedup", 5)):
        feeds = [torch.randint(0, 4096, (width,), generator=g) for _ in lengths]
        feeds[1] = feeds[0].clone()  # two sequences that route alike
        together = step.batch(feeds, [a for a, _ in caches], kernel=kernel, all_logits=True)
        for f, (_, cache), x in zip(feeds, caches, together, strict=True):
            assert torch.equal(x, step(f[None], cache, kernel=kernel, all_logits=True)[0])
        assert_same_caches(*zip(*caches, strict=True))


def greedy_alone(model, prompt, steps):
    cache = model.new_cache()
    logits = model(torch.tensor([prompt]), cache)
    out = []
    for _ in range(steps):
        out.append(int(logits[0, -1].argmax()))
        logits = model(torch.tensor([[out[-1]]]), cache)
    return out


def greedy_batched(model, prompts, steps, kernel="dedup"):
    caches = [model.new_cache() for _ in prompts]
    logits = batch_pass(model, prompts, caches, kernel=kernel)  # the prompts in one pass
    out = [[] for _ in prompts]
    for _ in range(steps):
        for tokens, x in zip(out, logits, strict=True):
            tokens.append(int(x[-1].argmax()))
        logits = batch_pass(model, [[t[-1]] for t in out], caches, kernel=kernel)
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_greedy_decoding_of_four_prompts_batched_equals_each_decoded_alone(checkpoints, family):
    model = native_model(checkpoints(family))
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 17, 8, 30)]
    passes = model.native_step().passes
    batched = greedy_batched(model, prompts, steps=16)
    assert model.native_step().passes - passes == 17  # the prompts' pass and one a step
    assert batched == [greedy_alone(model, p, 16) for p in prompts]


def test_the_fallback_is_exact_where_the_native_pass_does_not_run(checkpoints):
    g = torch.Generator().manual_seed(13)
    prompts, rounds = random_batch(g, 5)
    model = native_model(checkpoints("qwen3_moe"))
    model.native = False  # bf16, eager
    assert model.native_step() is None
    assert_batched_equals_solo(model, prompts, rounds, "slot")
    fp32 = load_model(checkpoints("qwen3_moe"), dtype="fp32")[0]
    assert fp32.native_step() is None
    for kernel in ("slot", "dedup", "reference"):
        assert_batched_equals_solo(fp32, prompts, rounds, kernel)
    model.native = True  # a kernel the native pass does not compute: each alone, eagerly
    passes = model.native_step().passes
    assert_batched_equals_solo(model, prompts, rounds, "reference")
    assert model.native_step().passes == passes + 2 * len(prompts)  # only the prompts'


def test_a_batch_past_the_native_passs_tokens_is_split_and_stays_exact(checkpoints):
    model = native_model(checkpoints("qwen3"))
    g = torch.Generator().manual_seed(14)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (2, 5, 9, 4)]
    big = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (100, 120, 90, 3)]
    # 100 + 120 in one pass, 90 + 3 in another
    assert_batched_equals_solo(model, prompts, [big], "dedup", passes=2)
    longer = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (MAX_TOKENS + 1, 2)]
    # the first runs eagerly alone (as it would alone), the second natively
    assert_batched_equals_solo(model, prompts[:2], [longer], "slot", passes=1)


def test_routing_sinks_see_each_sequences_own_routing(checkpoints):
    model = native_model(checkpoints("qwen3_moe"))
    g = torch.Generator().manual_seed(15)
    prompts, rounds = random_batch(g, 3)
    batched, alone = prefilled(model, prompts)
    seen = [[] for _ in prompts], [[] for _ in prompts]

    def sink(into):
        return lambda layer, ids, w: into.append((layer, ids.clone(), w.clone()))

    feeds = rounds[0]
    batch_pass(model, feeds, batched, kernel="dedup", sinks=[sink(s) for s in seen[0]])
    for f, c, s in zip(feeds, alone, seen[1], strict=True):
        model(torch.tensor([f]), c, kernel="dedup", routing_sink=sink(s))
    for mine, theirs, f in zip(*seen, feeds, strict=True):
        assert [x[0] for x in mine] == [x[0] for x in theirs] == [0, 2]  # the MoE layers
        for (_, ids, w), (_, ids_alone, w_alone) in zip(mine, theirs, strict=True):
            assert ids.shape == (len(f), 2)
            assert torch.equal(ids, ids_alone) and torch.equal(w, w_alone)
    quiet = batch_pass(model, rounds[1], batched, kernel="dedup", sinks=[None] * len(prompts))
    expected = solo(model, rounds[1], alone, "dedup", all_logits=False)
    assert all(torch.equal(a, b) for a, b in zip(quiet, expected, strict=True))


@pytest.mark.parametrize(
    "feeds, error, match",
    [
        ([[1, 2], []], ValueError, "sequence 1: a feed is a 1-D run of at least one token"),
        ([[1, 2], [[3, 4]]], ValueError, r"sequence 1: a feed is a 1-D run .* got \(1, 2\)"),
        ([[1.0], [2]], ValueError, "sequence 0: token ids are integers"),
        ([[1], [2, VOCAB]], IndexError, r"sequence 1: token ids outside the vocabulary \(0-95\)"),
        ([[-1], [2]], IndexError, "sequence 0: token ids outside the vocabulary"),
        # two passes (past 256 tokens): the bad token of the second refused before the first
        ([[1] * 200, [2] * 99 + [VOCAB]], IndexError, "sequence 1: token ids outside"),
    ],
)
def test_a_bad_feed_is_refused_by_sequence_and_no_cache_touched(checkpoints, feeds, error, match):
    model = native_model(checkpoints("qwen3_moe"))
    caches = prefilled(model, [[1, 2, 3], [4, 5]])[0]
    kept = [[t.clone() for t in c.keys + c.values] for c in caches]
    passes = model.native_step().passes
    with pytest.raises(error, match=match):
        batch_pass(model, feeds, caches, kernel="dedup")
    assert [c.length for c in caches] == [3, 2] and model.native_step().passes == passes
    for cache, before in zip(caches, kept, strict=True):
        assert all(
            torch.equal(a, b) for a, b in zip(cache.keys + cache.values, before, strict=True)
        )


def test_a_batch_of_mismatched_or_shared_caches_is_refused(checkpoints):
    model = native_model(checkpoints("qwen3_moe"))
    a, b = prefilled(model, [[1, 2, 3]])
    with pytest.raises(ValueError, match="each sequence needs its own cache"):
        batch_pass(model, [[1], [2]], [a[0], a[0]], kernel="slot")
    with pytest.raises(ValueError, match="one cache .* per sequence: 2 feeds, 1 caches"):
        batch_pass(model, [[1], [2]], [a[0]], kernel="slot")
    with pytest.raises(ValueError, match="2 feeds, 2 caches, 1 sinks"):
        batch_pass(model, [[1], [2]], [a[0], b[0]], kernel="slot", sinks=[None])
    with pytest.raises(ValueError, match="sequence 1: a cache of batch 1 per sequence"):
        batch_pass(model, [[1], [2]], [a[0], model.new_cache(batch=2)], kernel="slot")
    assert a[0].length == b[0].length == 3
    assert batch_pass(model, [], [], kernel="slot") == []


def test_the_native_batch_refuses_a_pass_it_cannot_hold(checkpoints):
    step = native_model(checkpoints("qwen3_moe")).native_step()
    empty = [torch.tensor([1, 2]), torch.tensor([], dtype=torch.int64)]
    with pytest.raises(ValueError, match="1-256 tokens in all and at least one a sequence"):
        step.batch(empty, [None, None], kernel="slot", all_logits=False)
    many = [torch.zeros(200, dtype=torch.int64), torch.zeros(57, dtype=torch.int64)]
    with pytest.raises(ValueError, match=r"got \[200, 57\]"):
        step.batch(many, [None, None], kernel="slot", all_logits=False)


def _batch_arguments(step: NativeStep, segments, **changes) -> list:
    """A call of moespec_step_batch that reads nothing before its checks (null pointers, but
    the model's and the segments'), with `changes` by argument name."""
    array = (_Segment * max(len(segments), 1))(*segments)
    names = nat._SIGNATURES["moespec_step_batch"][0].split()
    args = dict.fromkeys(names, 0)
    args.update(m=step._model, B=len(segments), segments=ctypes.addressof(array), threads=1)
    args.update(changes)
    return [args[n] for n in names], array


def _segment(T=1, start=0, capacity=16, attend_threads=1):
    return _Segment(T=T, start=start, capacity=capacity, attend_threads=attend_threads)


@pytest.mark.parametrize(
    "segments, changes, refused",
    [
        ([_segment(), _segment(T=0)], {}, "segments"),
        ([_segment(start=-1)], {}, "segments"),
        ([_segment(), _segment(start=15, T=2)], {}, "segments"),
        ([_segment(capacity=0)], {}, "segments"),
        ([_segment(attend_threads=0)], {}, "segments"),
        ([_segment(T=200, capacity=512), _segment(T=57, capacity=512)], {}, "segments"),
        ([_segment()], {"B": 0}, "B"),
        ([_segment()], {"threads": 0}, "threads"),
    ],
)
def test_the_c_batch_refuses_segments_out_of_bounds_by_name(
    checkpoints, segments, changes, refused
):
    step = native_model(checkpoints("qwen3_moe")).native_step()
    args, _kept = _batch_arguments(step, segments, **changes)
    with pytest.raises(ValueError, match=f"^moespec_step_batch refused {refused}: it needs "):
        nat.call("moespec_step_batch", *args)


def test_the_c_batch_refuses_a_model_whose_shapes_its_buffers_do_not_hold(checkpoints):
    step = native_model(checkpoints("qwen3_moe")).native_step()
    before = step.model.rotary
    step.model.rotary = 2048
    try:
        args, _kept = _batch_arguments(step, [_segment()])
        with pytest.raises(ValueError, match="refused m: it needs the model's shapes"):
            nat.call("moespec_step_batch", *args)
    finally:
        step.model.rotary = before
