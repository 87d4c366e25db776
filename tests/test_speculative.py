"""Speculative decoding: exactness, acceptance statistics and the draft-length policy."""

import math

import pytest
import torch

from moespec.costmodel import best_draft_length, expected_tokens
from moespec.decoding import (
    DraftLengthPolicy,
    KernelPolicy,
    ModelDrafter,
    OracleDrafter,
    PromptLookupDrafter,
    Sampler,
    generate,
    summarize,
    verify,
)
from moespec.decoding.setup import build_drafter, greedy_reference, runner_up_tokens
from moespec.decoding.suffix import SuffixDrafter
from moespec.models import load_model

PROMPT = [5, 17, 33, 2, 5, 17, 40, 41]


@pytest.fixture(scope="module")
def pair(checkpoint_dir):
    """(target MoE, dense draft with the same tokenizer), fp32."""
    target, tokenizer = load_model(checkpoint_dir("qwen3_moe")[0], dtype="fp32")
    draft, _ = load_model(checkpoint_dir("qwen3")[0], dtype="fp32")
    return target, draft


def tokens_of(records):
    return [t for r in records for t in r.tokens]


def drafters(target, draft, name, max_tokens):
    if name == "model":
        return ModelDrafter(draft, Sampler(), target.config.vocab_size)
    if name == "oracle":
        reference = greedy_reference(target, PROMPT, max_tokens)
        return OracleDrafter(reference, len(PROMPT), 0.6, target.config.vocab_size, seed=1)
    if name == "suffix":
        return SuffixDrafter()
    return PromptLookupDrafter()


@pytest.mark.parametrize("kernel", ["slot", "dedup", "reference", "auto"])
@pytest.mark.parametrize("name", ["model", "oracle", "lookup", "suffix"])
def test_greedy_speculative_output_equals_plain_greedy(pair, name, kernel):
    target, draft = pair
    kernels = KernelPolicy(kernel)
    plain = tokens_of(generate(target, PROMPT, max_tokens=24, kernels=kernels))
    for k in range(1, 9):
        records = list(
            generate(
                target,
                PROMPT,
                max_tokens=24,
                kernels=kernels,
                drafter=drafters(target, draft, name, 24),
                draft_policy=DraftLengthPolicy(k),
            )
        )
        assert tokens_of(records) == plain, (name, kernel, k)
        assert all(r.n_tokens == r.drafted + 1 for r in records[1:])


def test_auto_kernel_switches_at_the_crossover_during_speculation(pair):
    target, draft = pair
    records = list(
        generate(
            target,
            PROMPT,
            max_tokens=20,
            kernels=KernelPolicy("auto", crossover=3),
            drafter=ModelDrafter(draft, Sampler(), target.config.vocab_size),
            draft_policy=DraftLengthPolicy(4),
        )
    )
    for r in records[1:]:
        assert r.kernel == ("dedup" if r.n_tokens >= 3 else "slot")


def test_target_as_its_own_draft_accepts_every_draft(pair):
    target, _ = pair
    for sampler_args in ({}, {"temperature": 0.7, "seed": 3}):
        drafter = ModelDrafter(target, Sampler(**sampler_args), target.config.vocab_size)
        records = list(
            generate(
                target,
                PROMPT,
                max_tokens=30,
                sampler=Sampler(**sampler_args),
                drafter=drafter,
                draft_policy=DraftLengthPolicy(4),
            )
        )
        assert all(r.accepted == r.drafted for r in records[1:])
        assert sum(r.drafted for r in records) > 0


@pytest.mark.parametrize("positional", [False, True])
def test_oracle_acceptance_is_geometric_at_its_rate(pair, positional):
    target, _ = pair
    a, k, max_tokens = 0.7, 4, 400
    reference = greedy_reference(target, PROMPT, max_tokens)
    drafter = OracleDrafter(
        reference, len(PROMPT), a, target.config.vocab_size, seed=7, positional=positional
    )
    steps = list(
        generate(
            target,
            PROMPT,
            max_tokens=max_tokens,
            drafter=drafter,
            draft_policy=DraftLengthPolicy(k),
        )
    )[1:-1]  # full-length steps
    assert tokens_of(generate(target, PROMPT, max_tokens=max_tokens)) == reference
    # Per drafted position: a Bernoulli(a) success until the first failure.
    successes = sum(r.accepted for r in steps)
    trials = sum(r.accepted + (r.accepted < r.drafted) for r in steps)
    rate = successes / trials
    assert abs(rate - a) <= 4 * math.sqrt(a * (1 - a) / trials)
    # Tokens per step: mean G_a(k); variance of min(Geometric, k) + 1 computed exactly.
    probs = [a**j * (1 - a) for j in range(k)] + [a**k]
    mean = sum((j + 1) * p for j, p in enumerate(probs))
    var = sum((j + 1) ** 2 * p for j, p in enumerate(probs)) - mean**2
    assert mean == pytest.approx(expected_tokens(a, k))
    observed = sum(len(r.tokens) for r in steps) / len(steps)
    assert abs(observed - mean) <= 4 * math.sqrt(var / len(steps))


def test_model_drafter_proposes_the_draft_models_own_greedy_continuation(pair):
    target, draft = pair
    drafter = ModelDrafter(draft, Sampler(), target.config.vocab_size)
    context = list(PROMPT)
    for extra in ([9], [9, 3], [9, 4, 4]):  # contexts that share, then leave, the cached prefix
        proposed = drafter.propose(context + extra, 5).tokens
        expected = tokens_of(generate(draft, context + extra, max_tokens=5))
        assert proposed == expected


def test_prompt_lookup_copies_what_followed_the_last_ngram():
    drafter = PromptLookupDrafter(max_ngram=2)
    assert drafter.propose([1, 2, 3, 4, 9, 1, 2], 3).tokens == [3, 4, 9]
    assert drafter.propose([1, 2, 3, 1, 2, 7, 1, 2], 2).tokens == [7, 1]  # latest occurrence
    assert drafter.propose([1, 2, 3], 3).tokens == []


def test_draft_with_another_tokenizer_is_refused(checkpoint_dir, tmp_path, pair):
    import shutil

    from tests.checkpoints import write_tokenizer

    target, _ = pair
    other = tmp_path / "other"
    shutil.copytree(checkpoint_dir("qwen3")[0], other)
    write_tokenizer(other, 50)
    _, tokenizer = load_model(checkpoint_dir("qwen3_moe")[0], dtype="fp32")
    with pytest.raises(ValueError, match="different tokenizer vocabulary"):
        build_drafter(
            str(other),
            target=target,
            tokenizer=tokenizer,
            sampler=Sampler(),
            prompt=PROMPT,
            max_tokens=4,
            dtype="fp32",
        )


@pytest.mark.parametrize("deterministic", [False, True])
def test_exact_sampling_keeps_the_target_distribution(deterministic):
    stats = pytest.importorskip("scipy.stats")
    generator = torch.Generator().manual_seed(11)
    vocab, k, samples = 6, 3, 20000
    target_logits = torch.randn(k + 1, vocab, generator=generator) * 1.5
    draft_probs = torch.softmax(torch.randn(k, vocab, generator=generator) * 1.5, -1)
    sampler = Sampler(temperature=1.0, seed=5)
    counts = torch.zeros(vocab)
    for _ in range(samples):
        if deterministic:  # a drafter that always proposes the same tokens (point masses)
            drafts, probs = [0, 1, 2], None
        else:
            drafts = [
                int(torch.multinomial(draft_probs[i], 1, generator=generator)) for i in range(k)
            ]
            probs = draft_probs
        _, emitted = verify(drafts, target_logits, sampler, probs)
        counts[emitted[0]] += 1
    expected = torch.softmax(target_logits[0], -1) * samples
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < stats.chi2.ppf(0.999, df=vocab - 1)


def test_greedy_verify_accepts_the_matching_prefix_then_corrects():
    logits = torch.full((4, 5), -1.0)
    for i, best in enumerate([2, 4, 1, 3]):
        logits[i, best] = 1.0
    assert verify([2, 4, 0], logits, Sampler()) == (2, [2, 4, 1])
    assert verify([2, 4, 1], logits, Sampler()) == (3, [2, 4, 1, 3])
    assert verify([], logits[:1], Sampler()) == (0, [2])


def known_policy(step_times, acceptance):
    # A prior that pins the acceptance estimate at `acceptance`.
    return DraftLengthPolicy(
        "auto", step_times=step_times, prior=(acceptance * 1e6, (1 - acceptance) * 1e6)
    )


def test_auto_drafts_nothing_when_speculation_is_a_loss():
    step_times = [1.0, 2.5, 4.0, 5.5]  # each draft costs more than a plain step
    for a in (0.2, 0.5, 0.9):
        assert known_policy(step_times, a).choose() == 0


def test_auto_follows_the_staircase_on_known_step_times():
    step_times = [1.0, 1.2, 1.35, 1.45, 1.6, 1.8, 2.1, 2.5, 3.0]
    for a in (0.2, 0.4, 0.6, 0.7, 0.8, 0.9, 0.95):
        assert known_policy(step_times, a).choose() == best_draft_length(step_times, a)


def test_auto_estimates_acceptance_from_accepted_counts():
    policy = DraftLengthPolicy("auto", prior=(1.0, 1.0), forgetting=1.0)
    for accepted in (3, 4, 0, 2):  # of 4 drafted: failures after 3, none, at once, after 2
        policy.observe(4, 4, accepted, 0.01, 0.001)
    assert policy.acceptance_estimate == pytest.approx((1 + 9) / (1 + 9 + 1 + 3))


def test_auto_measures_step_times_online_and_interpolates():
    policy = DraftLengthPolicy("auto", max_draft_length=4)
    assert policy.choose() == 0  # warm-up: measure a plain step first
    policy.observe(0, 0, 0, 50.0, 0.0)  # the first pass of a size is dropped (one-time costs)
    assert policy.choose() == 0
    policy.observe(0, 0, 0, 1.0, 0.0)
    assert policy.choose() == 1  # then one draft
    policy.observe(1, 1, 1, 30.0, 4.0)
    policy.observe(1, 1, 1, 1.5, 0.1)
    table = policy.step_times()
    # tau(n) and h(k) extrapolated linearly: tau(1) = 1, tau(2) = 1.5; h(0) = 0, h(1) = 0.1.
    assert table[0] == pytest.approx(1.0) and table[1] == pytest.approx(1.6)
    assert table[4] == pytest.approx(3.0 + 0.4)
    assert policy.choose() == 1  # k* = 1 at a_hat = 0.67: the far end is not bought yet
    policy.observe_agreement(20, 0)  # (e.g. a cheap drafter's proposals, scored)
    assert policy.choose() >= 2  # k* >= 2 on the evidence...
    assert policy.choose() == 4  # ...so the far end is worth measuring now
    policy.observe(4, 4, 2, 9.0, 9.0)
    policy.observe(4, 4, 2, 2.0, 0.4)
    table = policy.step_times()  # now interpolated between the measured ends
    assert table[4] == pytest.approx(2.0 + 0.4)
    assert table[2] == pytest.approx(1.5 + 0.5 / 3 + 0.1 + 0.3 / 3)


def test_auto_warm_up_gives_up_on_lengths_the_drafter_never_fills():
    policy = DraftLengthPolicy("auto", max_draft_length=4, prior=(0.9e6, 0.1e6))
    seen = []
    for _ in range(16):
        k = policy.choose()
        seen.append(k)
        drafted = min(k, 1)  # a drafter that never proposes more than one token
        policy.observe(k, drafted, drafted, 1.0 + drafted, 0.0)
    assert seen.count(4) <= 4  # tries k_max a bounded number of times
    assert seen[-1] in (0, 1, 2)


def test_auto_probes_the_neighbours_of_its_choice():
    policy = DraftLengthPolicy(
        "auto", step_times=[1.0, 1.1, 1.2, 1.3, 1.4], probe_interval=4, prior=(0.8e6, 0.2e6)
    )
    best = best_draft_length([1.0, 1.1, 1.2, 1.3, 1.4], 0.8)
    choices = [policy.choose() for _ in range(8)]
    assert choices == [best] * 3 + [best - 1] + [best] * 3 + [min(best + 1, 4)]


def test_summary_counts_drafts(pair):
    target, draft = pair
    records = list(
        generate(
            target,
            PROMPT,
            max_tokens=16,
            drafter=ModelDrafter(draft, Sampler(), target.config.vocab_size),
            draft_policy=DraftLengthPolicy(3),
        )
    )
    summary = summarize(records)
    assert summary["drafted"] == sum(r.drafted for r in records)
    assert summary["generated_tokens"] == 16


def off_the_path(target, tokens=30, at=3):
    """The target's greedy continuation of PROMPT, and a reference that leaves it at `at`:
    the greedy path had that position gone the other way, and from there on is another text."""
    reference = greedy_reference(target, PROMPT, tokens)
    other = (reference[at] + 1) % target.config.vocab_size
    context = PROMPT + reference[:at] + [other]
    return reference, reference[:at] + [other] + greedy_reference(target, context, tokens - at - 1)


def test_oracle_follows_the_target_after_a_batch_rounding_divergence(pair):
    # A reference that leaves the target's greedy path (as a bf16 near-tie can) at position
    # 3: with resync the oracle takes up the target's path again; without, it stays lost.
    target, _ = pair
    reference, broken = off_the_path(target)

    def rejections(resync):
        drafter = OracleDrafter(broken, len(PROMPT), 1.0, target.config.vocab_size, resync=resync)
        records = list(
            generate(
                target, PROMPT, max_tokens=30, drafter=drafter, draft_policy=DraftLengthPolicy(4)
            )
        )
        assert tokens_of(records) == reference
        return sum(r.accepted < r.drafted for r in records)

    assert rejections(lambda context, n: greedy_reference(target, context, n)) == 1
    assert rejections(None) > 3


@pytest.fixture(scope="module")
def bf16_pair(checkpoint_dir):
    """The tiny pair in bf16, the target batch-invariant (as `moespec generate` runs it)."""
    target, _ = load_model(checkpoint_dir("qwen3_moe")[0], dtype="bf16")
    draft, _ = load_model(checkpoint_dir("qwen3")[0], dtype="bf16")
    target.batch_invariant = True
    return target, draft


@pytest.mark.parametrize("kernel", ["slot", "dedup", "auto"])
@pytest.mark.parametrize("name", ["model", "oracle", "lookup", "suffix"])
def test_greedy_speculative_output_equals_plain_greedy_in_bf16(bf16_pair, name, kernel):
    target, draft = bf16_pair
    kernels = KernelPolicy(kernel)
    prompt = PROMPT * 3  # a longer context: attention over more keys than one block
    plain = tokens_of(generate(target, prompt, max_tokens=32, kernels=kernels))
    for k in range(1, 9):
        drafter = drafters(target, draft, name, 32)
        if name == "oracle":
            reference = greedy_reference(target, prompt, 32)
            drafter = OracleDrafter(reference, len(prompt), 0.6, target.config.vocab_size, seed=1)
        records = generate(
            target,
            prompt,
            max_tokens=32,
            kernels=kernels,
            drafter=drafter,
            draft_policy=DraftLengthPolicy(k),
        )
        assert tokens_of(records) == plain, (name, kernel, k)


def test_positional_oracle_flags_are_shared_by_every_draft_length_and_acceptance():
    reference = list(range(10, 60))

    def drafts(acceptance, k):
        oracle = OracleDrafter(reference, 3, acceptance, 100, seed=5, positional=True)
        context = [0, 1, 2] + reference[:7]
        return oracle.propose(context, k).tokens

    long, short = drafts(0.6, 8), drafts(0.6, 2)
    assert long[:2] == short  # the same flags and replacements at the same positions
    wrong = {i for i, t in enumerate(drafts(0.6, 8)) if t != reference[7 + i]}
    wrong_lower = {i for i, t in enumerate(drafts(0.3, 8)) if t != reference[7 + i]}
    assert wrong <= wrong_lower  # u_p >= a: a lower acceptance flags a superset
    assert drafts(1.0, 8) == reference[7:15]


def test_oracle_alternatives_replace_exactly_the_flagged_drafts():
    reference = list(range(10, 60))
    alternatives = [t + 100 for t in reference]
    context = [0, 1, 2] + reference[:7]

    def oracle(**kw):
        return OracleDrafter(reference, 3, 0.6, 200, seed=5, positional=True, **kw)

    uniform = oracle().propose(context, 8).tokens
    runner_up = oracle(alternatives=alternatives).propose(context, 8).tokens
    truth = reference[7:15]
    wrong = [i for i in range(8) if uniform[i] != truth[i]]
    assert wrong  # the seed flags some of the 8 at a = 0.6
    # the same positions are wrong, each proposing its alternative instead of a shifted token
    assert [i for i in range(8) if runner_up[i] != truth[i]] == wrong
    assert all(runner_up[i] == alternatives[7 + i] for i in wrong)
    with pytest.raises(ValueError, match="2 for a reference of 50"):
        oracle(alternatives=[1, 2])
    with pytest.raises(ValueError, match="position 4 is the reference token"):
        oracle(alternatives=alternatives[:4] + [reference[4]] + alternatives[5:])


def test_runner_up_tokens_are_the_best_other_token_of_one_token_steps(bf16_pair):
    # independent of the teacher-forced chunks: decode token by token and rank each step's
    # logits in full (stable sort, the first index among equals, as topk's ties)
    target, _ = bf16_pair
    continuation = greedy_reference(target, PROMPT, 20)
    continuation[5] = (continuation[5] + 7) % target.config.vocab_size  # one off the greedy path
    got = runner_up_tokens(target, PROMPT, continuation, chunk=7)
    cache = target.new_cache(capacity=64)
    logits = target(torch.tensor(PROMPT), cache, kernel="dedup")
    expected = []
    for token in continuation:
        ranked = torch.sort(logits[0, -1].float(), descending=True, stable=True).indices.tolist()
        expected.append(next(t for t in ranked if t != token))
        logits = target(torch.tensor([token]), cache, kernel="dedup")
    assert got == expected
    assert all(a != t for a, t in zip(got, continuation, strict=True))
    # off the greedy path, the best other token is the greedy one
    assert got[5] == greedy_reference(target, PROMPT + continuation[:5], 1)[0]


def test_oracle_alternatives_follow_a_resync(bf16_pair):
    # a reference off the greedy path at position 3: after the resync, the re-derived tail
    # gets its own runner-ups (batch-invariant bf16: the same bits however the pass is cut)
    target, _ = bf16_pair
    reference, broken = off_the_path(target)
    drafter = OracleDrafter(
        broken,
        len(PROMPT),
        0.5,
        target.config.vocab_size,
        seed=3,
        resync=lambda context, n: greedy_reference(target, context, n),
        alternatives=runner_up_tokens(target, PROMPT, broken),
        alternatives_for=lambda context, tail: runner_up_tokens(target, context, tail),
    )
    records = generate(
        target, PROMPT, max_tokens=30, drafter=drafter, draft_policy=DraftLengthPolicy(4)
    )
    assert tokens_of(records) == reference and drafter.resyncs == 1
    assert drafter.reference == reference
    # the resync came at most one step (5 tokens) past position 3: from 8 on, all re-derived
    expected = runner_up_tokens(target, PROMPT + reference[:8], reference[8:])
    assert drafter.alternatives[8:] == expected
