"""A request's sampling: keyed (seeded) sampling, logit bias and penalties, logprobs, and tiny
temperatures, each exact under speculative decoding."""

import math

import pytest
import torch

from moespec.decoding import (
    DraftLengthPolicy,
    ModelDrafter,
    PromptLookupDrafter,
    Sampler,
    generate,
)
from moespec.decoding.adjust import LogitAdjust, token_logprobs
from moespec.decoding.suffix import SuffixDrafter
from moespec.models import load_model

PROMPT = [5, 17, 33, 2, 5, 17, 40, 41]


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def pair(checkpoint_dir, request):
    """(target MoE, dense draft), batch-invariant as the server and `generate` run them."""
    target, _ = load_model(checkpoint_dir("qwen3_moe")[0], dtype=request.param)
    draft, _ = load_model(checkpoint_dir("qwen3")[0], dtype=request.param)
    target.batch_invariant = True
    return target, draft


def tokens_of(records):
    return [t for r in records for t in r.tokens]


def run(target, drafter=None, k=None, sampler=None, **options):
    records = generate(
        target,
        PROMPT,
        max_tokens=24,
        sampler=sampler or Sampler(1.0, 0.9, seed=11, keyed=True),
        drafter=drafter,
        draft_policy=DraftLengthPolicy(k) if k else None,
        **options,
    )
    return list(records)


def drafter_for(name, target, draft, sampler):
    if name == "model":  # racing on the target's keys: coupled drafts
        return ModelDrafter(draft, sampler, target.config.vocab_size)
    return SuffixDrafter() if name == "suffix" else PromptLookupDrafter()


@pytest.mark.parametrize("name", ["model", "suffix", "lookup"])
def test_keyed_sampling_emits_the_same_tokens_with_and_without_drafts(pair, name):
    target, draft = pair
    plain = tokens_of(run(target))
    for k in (1, 3, 6):
        sampler = Sampler(1.0, 0.9, seed=11, keyed=True)
        drafter = drafter_for(name, target, draft, Sampler(1.0, 0.9, seed=11, keyed=True))
        records = run(target, drafter, k, sampler)
        assert tokens_of(records) == plain, (name, k)
        assert sum(r.drafted for r in records) > 0


def test_keyed_sampling_depends_on_the_seed(pair):
    target, _ = pair
    texts = {
        tuple(tokens_of(run(target, sampler=Sampler(1.0, seed=s, keyed=True)))) for s in (1, 2)
    }
    assert len(texts) == 2


def test_a_coupled_draft_model_is_accepted_where_it_agrees():
    """The target drafting for itself on the same keys proposes exactly its own samples."""
    probs = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(0)), -1)
    sampler = Sampler(1.0, seed=3, keyed=True)
    assert sampler.race(probs, 10) == [sampler.race(row, 10 + i)[0] for i, row in enumerate(probs)]


def test_the_race_draws_each_token_with_its_probability():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    sampler = Sampler(1.0, seed=7, keyed=True)
    draws = sampler.race(probs.expand(20_000, -1), position=0)
    counts = torch.bincount(torch.tensor(draws), minlength=5).float() / len(draws)
    # 20,000 draws: a standard error of at most 0.0035 per frequency
    assert torch.allclose(counts, probs, atol=0.015), counts
    assert counts[4] == 0  # a token of probability 0 never wins


def test_a_keyed_sampler_refuses_to_sample_without_a_position():
    with pytest.raises(ValueError, match="position"):
        Sampler(1.0, keyed=True).sample(torch.zeros(8))


def test_a_tiny_temperature_is_greedy_and_never_nan():
    logits = torch.tensor([3.0, 40.0, -2.0, 39.9])
    assert Sampler(1e-40).greedy and Sampler(1e-40).sample(logits) == 1
    probs = Sampler(1e-4).probabilities(logits)  # logits / T overflow float32 without care
    assert not probs.isnan().any() and int(probs.argmax()) == 1


def test_adjusted_verify_rows_equal_the_rows_of_plain_steps():
    """Row i of a verify pass sees the generated tokens plus drafts[:i], as a plain step."""
    logits = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    drafts = [3, 7, 3, 9]
    pass_ = LogitAdjust({3: 2.0, 30: -5.0}, presence=0.7, frequency=0.4)
    pass_.emitted([7, 7, 12])
    adjusted = pass_.apply(logits, drafts)
    for i in range(5):
        plain = LogitAdjust({3: 2.0, 30: -5.0}, presence=0.7, frequency=0.4)
        plain.emitted([7, 7, 12, *drafts[:i]])
        assert torch.equal(adjusted[i], plain.apply(logits[i])), i


def test_penalties_follow_openais_formula():
    logits = torch.zeros(6)
    adjust = LogitAdjust({1: 1.5}, presence=0.5, frequency=0.25)
    adjust.emitted([2, 2, 2, 4])
    # mu[j] + bias[j] - c[j] * frequency - (c[j] > 0) * presence
    expected = torch.tensor([0.0, 1.5, -3 * 0.25 - 0.5, 0.0, -0.25 - 0.5, 0.0])
    assert torch.allclose(adjust.apply(logits), expected)


def test_a_bias_of_minus_100_bans_the_greedy_choice(pair):
    target, _ = pair
    plain = tokens_of(run(target, sampler=Sampler()))
    banned = plain[0]
    adjusted = tokens_of(run(target, sampler=Sampler(), adjust=LogitAdjust({banned: -100.0})))
    assert banned not in adjusted


@pytest.mark.parametrize("name", ["model", "lookup"])
def test_adjusted_speculative_decoding_equals_adjusted_plain_decoding(pair, name):
    target, draft = pair

    def adjust():
        return LogitAdjust({9: 1.0}, presence=0.6, frequency=0.8)

    greedy = tokens_of(run(target, sampler=Sampler(), adjust=adjust()))
    keyed = tokens_of(run(target, adjust=adjust()))
    for k in (2, 5):
        drafter = drafter_for(name, target, draft, Sampler())
        assert tokens_of(run(target, drafter, k, Sampler(), adjust=adjust())) == greedy
        coupled = Sampler(1.0, 0.9, seed=11, keyed=True)
        drafter = drafter_for(name, target, draft, coupled)
        sampler = Sampler(1.0, 0.9, seed=11, keyed=True)
        assert tokens_of(run(target, drafter, k, sampler, adjust=adjust())) == keyed


def test_logprobs_are_the_same_with_and_without_speculation(pair):
    target, draft = pair
    plain = run(target, sampler=Sampler(), logprobs=3)
    drafter = ModelDrafter(draft, Sampler(), target.config.vocab_size)
    speculative = run(target, drafter, 4, Sampler(), logprobs=3)
    entries = [e for r in plain for e in r.logprobs]
    assert [e.token for e in entries] == tokens_of(plain)
    assert entries == [e for r in speculative for e in r.logprobs]
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top) == 3
        assert entry.top[0][1] >= entry.top[1][1] >= entry.top[2][1]
        assert entry.top[0] == (entry.token, entry.logprob)  # greedy: the best token


def test_token_logprobs_normalise_over_the_vocabulary():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    entries = token_logprobs(logits, [2, 0], top=0)
    assert math.isclose(entries[1].logprob, math.log(1 / 3), rel_tol=1e-6)
    assert entries[0].top == [] and entries[0].logprob > entries[1].logprob
