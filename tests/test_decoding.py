"""The decode loop, sampling, kernel policy and streamed text."""

import pytest
import torch

from moespec.decoding import KernelPolicy, Sampler, generate, summarize
from moespec.models import StreamingDetokenizer, Tokenizer, load_model


@pytest.fixture
def model(checkpoint_dir):
    directory, _ = checkpoint_dir("qwen3_moe")
    return load_model(directory, dtype="fp32")[0]


def test_records_cover_prefill_then_one_token_per_step(model):
    records = list(generate(model, [1, 2, 3], max_tokens=5))
    assert [r.phase for r in records] == ["prefill"] + ["decode"] * 4
    assert records[0].n_tokens == 3 and all(r.n_tokens == 1 for r in records[1:])
    assert all(len(r.tokens) == 1 for r in records)
    assert records[-1].finish_reason == "length" and all(
        r.finish_reason is None for r in records[:-1]
    )
    assert summarize(records)["generated_tokens"] == 5


def test_stop_token_ends_generation_and_is_not_emitted(model):
    free = [t for r in generate(model, [1, 2, 3], max_tokens=6) for t in r.tokens]
    stop = free[2]
    records = list(generate(model, [1, 2, 3], max_tokens=6, stop_tokens=[stop]))
    tokens = [t for r in records for t in r.tokens]
    assert tokens == free[: free.index(stop)]
    assert records[-1].finish_reason == "stop"


def test_kernel_choice_does_not_change_greedy_tokens(model):
    runs = {
        k: [
            t
            for r in generate(model, [5, 6, 7], max_tokens=8, kernels=KernelPolicy(k))
            for t in r.tokens
        ]
        for k in ("slot", "dedup", "reference")
    }
    assert runs["slot"] == runs["dedup"] == runs["reference"]


def test_sampling_is_reproducible_by_seed(model):
    def tokens(seed):
        sampler = Sampler(temperature=1.0, seed=seed)
        return [
            t for r in generate(model, [1, 2], max_tokens=12, sampler=sampler) for t in r.tokens
        ]

    assert tokens(3) == tokens(3)
    assert tokens(3) != tokens(4)


def test_kernel_policy_switches_at_the_crossover():
    policy = KernelPolicy("auto", crossover=4)
    assert [policy.for_pass(n) for n in (1, 2, 3, 4, 9)] == ["slot"] * 3 + ["dedup"] * 2
    assert KernelPolicy("slot").for_prefill() == "dedup"
    with pytest.raises(ValueError, match="unknown kernel 'fast'"):
        KernelPolicy("fast")


def test_auto_kernel_without_a_crossover_measures_both_and_runs_the_faster():
    policy = KernelPolicy("auto", explore=2)
    for n in (2, 6):
        for _ in range(2):
            for kernel in ("slot", "dedup"):
                assert policy.for_pass(n) in ("slot", "dedup")
                # dedup 1 ms faster at n = 6, 1 ms slower at n = 2
                policy.observe(
                    n,
                    kernel,
                    10.0
                    + (n == 6) * (kernel == "slot") * 1e-3
                    + (n == 2) * (kernel == "dedup") * 1e-3,
                )
    assert policy.for_pass(2) == "slot" and policy.for_pass(6) == "dedup"
    assert policy.for_pass(1) == "slot"
    assert policy.measured_crossover() == 6


def test_auto_kernel_explores_by_alternating():
    policy = KernelPolicy("auto", explore=2)
    seen = []
    for _ in range(4):
        kernel = policy.for_pass(3)
        seen.append(kernel)
        policy.observe(3, kernel, 1.0)
    assert sorted(seen) == ["dedup", "dedup", "slot", "slot"]


def test_greedy_sampler_takes_the_argmax_and_top_p_truncates():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert Sampler().sample(logits) == 1
    probs = Sampler(temperature=1.0, top_p=0.5).probabilities(logits)
    assert probs[1] == 1.0 and probs.sum() == 1.0  # the top token alone already holds >= 0.5
    wide = Sampler(temperature=1.0, top_p=0.9).probabilities(logits)
    assert (wide > 0).tolist() == [False, True, True, False]


def test_streamed_text_never_splits_a_character(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    raw = HFTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(
        ["plain ascii text"] * 5,
        trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )
    raw.save(str(tmp_path / "tokenizer.json"))
    tokenizer = Tokenizer(tmp_path / "tokenizer.json")
    text = "naïve café — 東京"
    ids = tokenizer.encode(text)
    stream = StreamingDetokenizer(tokenizer)
    pieces = [stream.add([i]) for i in ids] + [stream.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_streaming_detokenizer_decodes_a_window_not_the_whole_sequence():
    """Each add decodes a window of the newest ids: its cost does not grow with the
    generation (a whole decode would take all 1,000-odd ids), and the pieces are still the
    whole decode."""
    from moespec.demo import demo_paths

    tokenizer = Tokenizer(demo_paths()[0] / "tokenizer.json")
    ids = tokenizer.encode('def f(x):\n    """Return x, "naïve" — 東京."""\n    return x\n' * 40)
    decoded = []
    decode = tokenizer.decode
    tokenizer.decode = lambda window: decoded.append(len(window)) or decode(window)
    stream = StreamingDetokenizer(tokenizer)
    pieces = []
    for i in range(0, len(ids), 3):
        pieces.append(stream.add(ids[i : i + 3]))
    assert len(ids) > 1000 and max(decoded) <= 24
    pieces.append(stream.flush())
    assert "".join(pieces) == decode(ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64, torch.bfloat16])
def test_greedy_tokens_are_torch_argmax_with_ties_nans_and_infinities(dtype):
    from moespec.decoding.sampling import greedy_tokens

    generator = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 4, (9, 257), generator=generator).to(dtype)  # many ties
    logits[1, 5] = float("inf")
    logits[2, :] = float("-inf")
    logits[3, 7] = logits[3, 200] = float("nan")  # the first NaN counts as the maximum
    logits[4, 100:] = logits[4, :100].max() + 1  # the first of a run of maxima
    strided = logits[:, ::2]  # not contiguous
    for x in (logits, strided, logits[:-1]):
        assert greedy_tokens(x) == torch.argmax(x, -1).tolist()
        for row in x:
            token = greedy_tokens(row)
            assert isinstance(token, int) and token == int(torch.argmax(row))
    assert greedy_tokens(logits[3]) == 7
