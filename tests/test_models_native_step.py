"""The native model pass (moespec.models.native_step): one call per pass, as accurate as the
eager bf16 pass, each row of a verification pass with its one-token bits, eager where it
cannot run and saying why. Where `moespec env` says the pass runs on this machine, a model it
declines fails these tests: they skip only with the machine's own reason (tests.native)."""

import pytest
import torch

from moespec.decoding import Sampler, generate
from moespec.decoding.draft_policy import DraftLengthPolicy
from moespec.decoding.drafters import ModelDrafter
from moespec.kernels import native as nat
from moespec.kernels.isa import this_cpu
from moespec.models import load_model
from moespec.models.native_step import NativeStep
from tests.checkpoints import hf_model, save_checkpoint
from tests.native import (
    NATIVE_FAMILIES,
    native_checkpoints,
    native_model,
    needs_attention,
    needs_loops,
    needs_native_pass,
)

FAMILIES = NATIVE_FAMILIES


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return native_checkpoints(tmp_path_factory)


def teacher_forced(model, prompt, tokens, kernel="slot") -> torch.Tensor:
    """Logits [len(tokens), V] of one-token steps feeding `tokens` after the prompt."""
    cache = model.new_cache()
    model(torch.tensor([prompt]), cache)
    return torch.stack([model(torch.tensor([[t]]), cache, kernel=kernel)[0, -1] for t in tokens])


def stream(seed=0, prompt=12, tokens=20, vocab=96):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, vocab, (prompt,), generator=g).tolist(),
        torch.randint(0, vocab, (tokens,), generator=g).tolist(),
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_native_pass_is_as_accurate_as_the_eager_bf16_pass(checkpoints, family):
    model = native_model(checkpoints(family))
    reference = load_model(checkpoints(family), dtype="fp32")[0]
    prompt, tokens = stream()
    exact = teacher_forced(reference, prompt, tokens)
    steps = model.native_step().passes
    native = teacher_forced(model, prompt, tokens)
    assert model.native_step().passes - steps == 1 + len(tokens)  # the prompt and every step
    model.native = False
    eager = teacher_forced(model, prompt, tokens)

    def error(x):
        return ((x - exact).abs().max() / exact.abs().max()).item()

    # measured: 0.4-1.0% of the largest logit for both; native within 0.8% of eager
    assert error(native) <= 1.5 * error(eager) + 1e-3
    assert error(native) < 0.03


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("kernel", ["slot", "dedup"])
def test_a_verification_pass_gives_every_row_its_one_token_bits(checkpoints, family, kernel):
    model = native_model(checkpoints(family))
    prompt, tokens = stream(1, tokens=9)
    one, many = model.new_cache(), model.new_cache()
    model(torch.tensor([prompt]), one)
    model(torch.tensor([prompt]), many)
    steps = torch.cat([model(torch.tensor([[t]]), one, kernel=kernel) for t in tokens], dim=1)
    passes = model.native_step().passes
    verified = model(torch.tensor([tokens]), many, kernel=kernel, all_logits=True)
    assert model.native_step().passes == passes + 1  # the nine tokens in one native pass
    assert torch.equal(verified, steps)
    assert one.length == many.length == len(prompt) + len(tokens)
    for a, b in zip(one.keys + one.values, many.keys + many.values, strict=True):
        assert torch.equal(a[:, :, : one.length], b[:, :, : many.length])


def test_slot_and_dedup_orders_give_the_same_bits(checkpoints):
    model = native_model(checkpoints("qwen3_moe"))
    prompt, tokens = stream(2)
    # a pass whose tokens share experts: the deduplicating order groups their rows
    repeated = [tokens[0]] * 4 + tokens[:5]
    results = []
    for kernel in ("slot", "dedup"):
        cache = model.new_cache()
        model(torch.tensor([prompt]), cache)
        results.append(model(torch.tensor([repeated]), cache, kernel=kernel, all_logits=True))
    assert torch.equal(*results)


def test_speculative_greedy_equals_plain_greedy_on_native_passes(checkpoints):
    target = native_model(checkpoints("qwen3_moe"))
    draft = native_model(checkpoints("qwen3"))
    prompt = stream(3)[0]

    def tokens(records):
        return [t for r in records for t in r.tokens]

    plain = tokens(generate(target, prompt, max_tokens=40))
    passes = target.native_step().passes
    drafter = ModelDrafter(draft, Sampler(), target.config.vocab_size)
    speculative = tokens(
        generate(target, prompt, max_tokens=40, drafter=drafter, draft_policy=DraftLengthPolicy(4))
    )
    assert speculative == plain
    assert target.native_step().passes > passes and draft.native_step().passes > 0


def test_the_routing_sink_sees_the_routing_and_changes_nothing(checkpoints):
    model = native_model(checkpoints("qwen3_moe"))
    prompt, tokens = stream(4, tokens=6)
    seen = {False: [], True: []}

    def run(native, sink):
        model.native = native
        cache = model.new_cache()
        model(torch.tensor([prompt]), cache)
        return model(torch.tensor([tokens]), cache, all_logits=True, routing_sink=sink)

    quiet = run(True, None)
    traced = run(True, lambda layer, ids, w: seen[True].append((layer, ids.clone(), w.clone())))
    assert torch.equal(quiet, traced)
    run(False, lambda layer, ids, w: seen[False].append((layer, ids.clone(), w.clone())))
    assert [x[0] for x in seen[True]] == [x[0] for x in seen[False]] == [0, 2]  # MoE layers
    for (_, ids, weights), (_, eager_ids, eager_weights) in zip(*seen.values(), strict=True):
        assert ids.shape == (len(tokens), 2) and ids.dtype == torch.int64
        assert torch.equal(ids, eager_ids)
        torch.testing.assert_close(weights, eager_weights, atol=2e-2, rtol=0)
        torch.testing.assert_close(weights.sum(-1), torch.ones(len(tokens)))  # renormalised


def test_int8_weights_run_natively(checkpoints):
    needs_loops("int8")
    model = native_model(checkpoints("qwen3_moe"), weights="int8")
    prompt, tokens = stream(5, tokens=9)
    native = teacher_forced(model, prompt, tokens)
    model.native = False
    eager = teacher_forced(model, prompt, tokens)
    # the same int8 products; only the norms' and softmax's rounding orders differ
    assert ((native - eager).abs().max() / eager.abs().max()).item() < 0.02
    model.native = True
    cache = model.new_cache()
    model(torch.tensor([prompt]), cache)
    assert torch.equal(model(torch.tensor([tokens]), cache, all_logits=True)[0], native)


def test_a_cache_that_grows_during_native_passes_keeps_its_positions(checkpoints):
    model = native_model(checkpoints("qwen3"))
    prompt, tokens = stream(6, prompt=3, tokens=20)
    big, small = model.new_cache(capacity=256), model.new_cache(capacity=4)
    for cache in (big, small):
        model(torch.tensor([prompt]), cache)
    a = torch.cat([model(torch.tensor([[t]]), big) for t in tokens], dim=1)
    b = torch.cat([model(torch.tensor([[t]]), small) for t in tokens], dim=1)
    assert small.capacity > 4 and torch.equal(a, b)


def test_the_avx2_loops_give_a_native_pass_of_the_same_properties(checkpoints):
    needs_native_pass("avx2")
    model = native_model(checkpoints("qwen3_moe"))
    avx2 = NativeStep(model, family="avx2")
    prompt, tokens = stream(7, tokens=9)
    caches = [model.new_cache() for _ in range(3)]
    for cache in caches:
        model(torch.tensor([prompt]), cache)
    rows = avx2(torch.tensor([tokens]), caches[0], kernel="dedup", all_logits=True)
    steps = torch.cat(
        [avx2(torch.tensor([[t]]), caches[1], kernel="slot", all_logits=False) for t in tokens],
        dim=1,
    )
    assert torch.equal(rows, steps)
    this_cpu = model(torch.tensor([tokens]), caches[2], all_logits=True)
    assert ((rows - this_cpu).abs().max() / this_cpu.abs().max()).item() < 0.02


def test_passes_the_native_pass_cannot_take_run_eagerly_and_say_why(checkpoints):
    needs_native_pass()  # the notes below are the model's, after the machine's
    fp32 = load_model(checkpoints("qwen3_moe"), dtype="fp32")[0]
    assert fp32.native_report() == {
        "native": False,
        "note": "the native pass computes in bf16, the model in torch.float32",
    }
    unpacked = load_model(checkpoints("qwen3_moe"), dtype="bf16", pack=False)[0]
    assert unpacked.native_step() is None
    assert "not packed" in unpacked.native_report()["note"]
    clipped = save_checkpoint(hf_model("olmoe"), checkpoints("olmoe").parent / "clipped")
    assert "clipping" in load_model(clipped, dtype="bf16")[0].native_report()["note"]

    model = native_model(checkpoints("qwen3_moe"))
    model.native = False
    assert model.native_report() == {"native": False, "note": "off"}
    model.native = True
    prompt, tokens = stream(8, tokens=4)
    cache = model.new_cache()
    model(torch.tensor([prompt]), cache)
    passes = model.native_step().passes
    model(torch.tensor([tokens]), cache, kernel="reference")  # a kernel it does not compute
    model(torch.randint(0, 96, (1, 257)), model.new_cache())  # a prompt of over 256 tokens
    model(
        torch.tensor([tokens]), cache, offload=lambda layer, x, ids, w, kernel: torch.zeros_like(x)
    )
    assert model.native_step().passes == passes


def test_compile_auto_leaves_the_steps_to_the_native_pass(checkpoints):
    from moespec.models.compiled import capture

    model = native_model(checkpoints("qwen3"))
    report = capture(model, "auto")
    assert report == {
        "mode": "auto",
        "captured": False,
        "note": "decoding natively: the native pass runs every step",
    }
    assert model.captured_step is None


def test_a_token_outside_the_vocabulary_is_refused_and_the_cache_kept(checkpoints):
    model = native_model(checkpoints("qwen3"))
    cache = model.new_cache()
    model(torch.tensor([[1, 2, 3]]), cache)
    with pytest.raises(IndexError, match=r"outside the vocabulary \(0-95\)"):
        model(torch.tensor([[4, 96]]), cache)
    assert cache.length == 3


def test_a_cache_whose_inner_layers_moved_is_written_where_they_are_now(checkpoints):
    # A new cache can reuse an old one's id and first tensor's address with its other
    # tensors elsewhere: the pass must write and read every layer where it is now.
    model = native_model(checkpoints("qwen3"))
    prompt, tokens = stream(9, prompt=3, tokens=6)
    cache = model.new_cache()
    model(torch.tensor([prompt]), cache)
    expected = model(torch.tensor([tokens]), cache, all_logits=True)
    written = [
        t[:, :, len(prompt) : cache.length].clone() for t in (cache.keys[1], cache.values[1])
    ]
    cache.rollback(len(prompt))
    for store in (cache.keys, cache.values):  # the second layer's tensors at new addresses,
        store[1] = store[1].clone()  # the pass's positions cleared
        store[1][:, :, len(prompt) :] = 0
    moved = model(torch.tensor([tokens]), cache, all_logits=True)
    assert torch.equal(moved, expected)
    for t, before in zip((cache.keys[1], cache.values[1]), written, strict=True):
        assert torch.equal(t[:, :, len(prompt) : cache.length], before)


@pytest.mark.parametrize("family", ["this", "avx2"])
@pytest.mark.parametrize("shape", [(4, 2, 64, 64), (6, 3, 40, 24), (8, 1, 128, 128)])
def test_the_rows_attention_gives_each_row_its_one_row_bits(family, shape):
    # one call over a pass's rows, each query row over itself and the rows before it: the bits
    # of the one-row attention over exactly those positions (heads of a key head and rows
    # share a sweep; ragged head dims take the scalar ends)
    family = this_cpu()[2] if family == "this" else family
    needs_attention(family)
    heads, kv, dim, dv = shape
    g = torch.Generator().manual_seed(sum(shape))
    rows, length = 9, 40
    keys = torch.randn(1, kv, length, dim, generator=g).to(torch.bfloat16)
    values = torch.randn(1, kv, length, dv, generator=g).to(torch.bfloat16)
    q = torch.randn(rows, heads, dim, generator=g).to(torch.bfloat16)
    together = nat.attend_rows(q, keys, values, dim**-0.5, family=family)
    one = getattr(nat.native().lib, nat.ATTENTION[family])
    for t in range(rows):
        seen = length - rows + 1 + t
        out = torch.empty(heads * dv, dtype=torch.bfloat16)
        k, v = keys[:, :, :seen], values[:, :, :seen]
        args = (heads, heads // kv, seen, dim, dv, k.stride(1), k.stride(2), v.stride(1))
        assert (
            one(
                q[t].contiguous().data_ptr(),
                k.data_ptr(),
                v.data_ptr(),
                out.data_ptr(),
                *args,
                v.stride(2),
                dim**-0.5,
                1,
            )
            == 0
        )
        assert torch.equal(together[t], out), t
    for threads in (1, 2):  # the threads split key heads, never a query's sums
        assert torch.equal(nat.attend_rows(q, keys, values, dim**-0.5, family, threads), together)


@pytest.fixture(scope="module")
def demo_target():
    from moespec.demo import demo_paths

    needs_native_pass()
    model = load_model(demo_paths()[0])[0]
    assert model.native_report() == {"native": True, "note": None}
    return model


@pytest.mark.parametrize("family", ["this", "avx2"])
def test_the_demo_targets_nine_token_pass_is_nine_one_token_passes(demo_target, family):
    # the pass speculation verifies with, on the model it is measured on: every row (logits,
    # keys, values) of one pass of 9 has the bits of 9 one-token passes, in either expert order
    family = this_cpu()[2] if family == "this" else family
    needs_native_pass(family)
    step = NativeStep(demo_target, family=family)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 4096, (1, 64), generator=g)
    tokens = torch.randint(0, 4096, (1, 9), generator=g)
    tokens[0, 5] = tokens[0, 2]  # a repeated token: rows that share every expert
    results = []
    for kernel in ("slot", "dedup"):
        one, many = demo_target.new_cache(capacity=128), demo_target.new_cache(capacity=128)
        for cache in (one, many):
            step(prompt, cache, kernel=kernel, all_logits=False)
        steps = torch.cat(
            [step(tokens[:, i : i + 1], one, kernel=kernel, all_logits=True) for i in range(9)],
            dim=1,
        )
        verified = step(tokens, many, kernel=kernel, all_logits=True)
        assert torch.equal(verified, steps), kernel
        for a, b in zip(one.keys + one.values, many.keys + many.values, strict=True):
            assert torch.equal(a[:, :, :73], b[:, :, :73])
        last = step(tokens[:, :1], many, kernel=kernel, all_logits=False)  # its scratch reused
        results.append((verified, last))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))  # slot == dedup


def test_a_pass_whose_scratch_is_held_takes_buffers_of_its_own(demo_target):
    # two threads in one model's passes: the second finds the kept buffers held and takes its
    # own, with the same bits
    step = NativeStep(demo_target)
    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, 4096, (1, 16), generator=g)
    caches = [demo_target.new_cache(capacity=64) for _ in range(2)]
    for cache in caches:
        step(prompt, cache, kernel="slot", all_logits=False)
    tokens = torch.randint(0, 4096, (1, 5), generator=g)
    free = step(tokens, caches[0], kernel="dedup", all_logits=True)
    step._scratch.busy = 1
    try:
        held = step(tokens, caches[1], kernel="dedup", all_logits=True)
    finally:
        step._scratch.busy = 0
    assert torch.equal(free, held)


def test_greedy_bf16_generation_takes_the_native_pass_wherever_env_says_it_runs(checkpoints):
    # `moespec env` says the pass runs on this machine (else skipped with its reason): every
    # pass of plain greedy decoding of a supported bf16 checkpoint is then a native one
    model = native_model(checkpoints("qwen3_moe"))
    records = list(generate(model, stream(10)[0], max_tokens=12))
    assert sum(len(r.tokens) for r in records) == 12
    assert model.native_step().passes == len(records)  # the prompt's pass and every step's


def test_a_pass_past_the_caches_capacity_is_refused_by_name_and_the_cache_kept(
    checkpoints, monkeypatch
):
    model = native_model(checkpoints("qwen3"))
    cache = model.new_cache(capacity=8)
    model(torch.tensor([[1, 2, 3, 4, 5, 6]]), cache)
    monkeypatch.setattr(cache, "reserve", lambda tokens: None)  # a cache that does not grow
    kept = [t.clone() for t in cache.keys + cache.values]
    wanted = r"moespec_step refused capacity: it needs start \+ T <= capacity \(.*T = 4, start = 6"
    with pytest.raises(ValueError, match=wanted + ", capacity = 8"):
        model(torch.tensor([[1, 2, 3, 4]]), cache, all_logits=True)
    assert cache.length == 6
    assert all(torch.equal(a, b) for a, b in zip(kept, cache.keys + cache.values, strict=True))


def _step_arguments(step: NativeStep, **changes) -> list:
    """A call of moespec_step that reads nothing before its checks (null pointers, but the
    model's), with `changes` by argument name."""
    names = nat._SIGNATURES["moespec_step"][0].split()
    args = dict.fromkeys(names, 0)
    args.update(m=step._model, T=1, start=0, capacity=16, threads=1, attend_threads=1)
    args.update(changes)
    return [args[n] for n in names]


@pytest.mark.parametrize(
    "changes, refused",
    [
        ({"T": 0}, "T"),
        ({"T": -3}, "T"),
        ({"start": -1}, "start"),
        ({"start": 15, "T": 2}, "capacity"),
        ({"capacity": 0}, "capacity"),
        ({"threads": 0}, "threads"),
        ({"attend_threads": -1}, "attend_threads"),
    ],
)
def test_the_c_pass_refuses_arguments_out_of_bounds_by_name(checkpoints, changes, refused):
    step = native_model(checkpoints("qwen3_moe")).native_step()
    with pytest.raises(ValueError, match=f"^moespec_step refused {refused}: it needs "):
        nat.call("moespec_step", *_step_arguments(step, **changes))


def test_the_c_pass_refuses_a_model_whose_shapes_its_buffers_do_not_hold(checkpoints):
    step = native_model(checkpoints("qwen3_moe")).native_step()
    heads = step.model.heads
    for field, value in (("rotary", 2048), ("rotary", 3), ("kv_heads", heads + 1)):
        before = getattr(step.model, field)
        setattr(step.model, field, value)
        try:
            with pytest.raises(ValueError, match="refused m: it needs the model's shapes"):
                nat.call("moespec_step", *_step_arguments(step))
        finally:
            setattr(step.model, field, before)
    moe = step.moe_layers[0]
    step._layers[moe].top_k = step._layers[moe].experts + 1  # more than its experts to pick
    with pytest.raises(ValueError, match="refused m"):
        nat.call("moespec_step", *_step_arguments(step))
