"""Speculation that never loses: plain steps that run no drafter, bounded probing, the choice
among drafters, cheap evidence, and the paired comparison with plain decoding."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moespec.cli import main
from moespec.decoding import (
    DraftLengthPolicy,
    KernelPolicy,
    ModelDrafter,
    PromptLookupDrafter,
    Sampler,
    generate,
)
from moespec.decoding.compare import compare_plain
from moespec.decoding.drafters import Draft
from moespec.decoding.speculation import Proposal, Speculation
from moespec.models import load_model

PROMPT = [5, 17, 33, 2, 5, 17, 40, 41, 5, 17]
LOSS = [1.0, 5.0, 9.0, 13.0, 17.0]  # V(k): drafting costs four plain steps per token


@pytest.fixture(scope="module")
def pair(checkpoint_dir):
    target, _ = load_model(checkpoint_dir("qwen3_moe")[0], dtype="fp32")
    draft, _ = load_model(checkpoint_dir("qwen3")[0], dtype="fp32")
    return target, draft


class CountingModel:
    """A model whose passes are counted (the drafter runs it as it is)."""

    def __init__(self, model):
        self.model, self.passes = model, 0

    def new_cache(self, *args, **kwargs):
        return self.model.new_cache(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        self.passes += 1
        return self.model(*args, **kwargs)


def tokens_of(records):
    return [t for r in records for t in r.tokens]


def probe_gaps(policy, steps):
    """The plain steps between probes while every probe is rejected at once."""
    probes = []
    for step in range(steps):
        k = policy.choose()
        if k:
            probes.append(step)
        policy.observe(k, k, 0, 1.0, 0.0)
    return [b - a for a, b in zip([-1, *probes], probes, strict=False)]


def test_probes_while_drafting_never_pays_come_at_doubling_gaps():
    # a one-token draft costs 0.2 plain steps: under both budgets' share of the gaps
    cheap_loss = [1.0, 1.2, 1.4, 1.6, 1.8]
    policy = DraftLengthPolicy("auto", step_times=cheap_loss, prior=(1.0, 9.0), probe_interval=16)
    gaps = probe_gaps(policy, 1500)
    assert gaps[:6] == [17, 33, 65, 129, 257, 257]  # 16, 32, ... plain steps, capped at 256
    assert len(gaps) <= 9  # of 1500 steps


def test_a_probe_waits_until_the_budget_has_earned_its_cost():
    from moespec.decoding.draft_policy import EXPLORE_BUDGET, HOPELESS_BUDGET

    assert (EXPLORE_BUDGET, HOPELESS_BUDGET) == (0.02, 0.005)
    # A probe (one drafted token) costs 0.5 plain steps. At a = 0.3 + 2 deviations of
    # Beta(3, 7) (0.58) one draft pays, so the probe waits for 0.5 / 0.02 = 25 plain steps
    # (not 16); once rejections have brought the optimistic acceptance under the break-even
    # 0.5 of V(1) = 1.5 (third probe), for 0.5 / 0.005 = 100 (not 64).
    policy = DraftLengthPolicy("auto", step_times=[1.0, 1.5, 2.0, 2.5, 3.0], prior=(3.0, 7.0))
    assert probe_gaps(policy, 700)[:5] == [26, 33, 101, 129, 257]
    # Drafting costs four plain steps a token (LOSS): even at the optimistic acceptance k*
    # is 0 from the start, so a probe waits 4 / 0.005 = 800 plain steps.
    policy = DraftLengthPolicy("auto", step_times=LOSS, prior=(1.0, 9.0))
    assert probe_gaps(policy, 2000) == [801, 801]


def test_a_probe_that_is_not_a_draft_is_priced_at_what_it_cost():
    policy = DraftLengthPolicy("auto", step_times=LOSS, prior=(1.0, 9.0))
    policy.observe_probe(2.0)  # a catch-up that took two plain steps (LOSS: 0.005 budget)
    assert probe_gaps(policy, 1000)[:2] == [401, 401]


def test_probe_gap_returns_to_its_base_once_drafting_pays():
    step_times = [1.0, 1.05, 1.1, 1.15, 1.2]  # drafting is cheap: pays from a = 0.05
    policy = DraftLengthPolicy("auto", step_times=step_times, prior=(1.0, 19.0))
    for _ in range(60):  # acceptance estimate <= 0.05: plain steps, two rejected probes
        k = policy.choose()
        policy.observe(k, k, 0, 1.0, 0.0)
    assert policy.probe_gap == 64
    policy.observe_agreement(10, 0)  # evidence that the drafts would now pass
    assert policy.choose() > 0 and policy.probe_gap == 16


def test_without_a_plan_only_pass_sizes_one_and_two_are_bought_before_drafting_pays():
    policy = DraftLengthPolicy("auto", max_draft_length=8, prior=(1.0, 9.0))
    chosen = []
    for _ in range(12):
        k = policy.choose()
        chosen.append(k)
        policy.observe(k, k, 0, 1.0 + 0.3 * k, 0.5 * k)
    assert max(chosen) == 1 and 8 not in chosen


def brute_force_lookup(context, k, max_ngram=3):
    for n in range(min(max_ngram, len(context) - 1), 0, -1):
        for start in range(len(context) - n - 1, -1, -1):
            if context[start : start + n] == context[-n:]:
                return context[start + n : start + n + k]
    return []


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=8),
    st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=3), max_size=12),
    st.integers(1, 5),
)
def test_lookup_index_proposes_what_a_scan_of_the_context_finds(start, growth, k):
    drafter, context = PromptLookupDrafter(), list(start)
    assert drafter.propose(context, k).tokens == brute_force_lookup(context, k)
    for tokens in growth:  # the context grows as decoding emits tokens
        context.extend(tokens)
        assert drafter.propose(context, k).tokens == brute_force_lookup(context, k)
    other = context[::-1]  # another context: the index starts again
    assert drafter.propose(other, k).tokens == brute_force_lookup(other, k)


def test_catch_up_scores_the_draft_greedy_predictions_at_the_missed_positions(pair):
    _, draft = pair
    drafter = ModelDrafter(draft, Sampler(), draft.config.vocab_size)
    context = PROMPT + [7, 9, 11, 5, 17]
    fed, agreed = drafter.catch_up(context, evidence=True)
    logits = draft(torch.tensor(context), draft.new_cache(), all_logits=True)[0]
    predicted = logits[:-1].argmax(-1).tolist()
    assert fed == len(context)
    assert agreed == sum(p == t for p, t in zip(predicted, context[1:], strict=True))
    assert drafter.catch_up(context) == (0, 0)  # nothing missed: nothing run


def test_an_unused_lookup_proposal_is_scored_against_the_emitted_tokens():
    speculation = Speculation.auto([PromptLookupDrafter()], prior=(1.0, 1.0), forgetting=1.0)
    policy = speculation.policies["lookup"]
    plain_step = Proposal(None, 0, Draft([]), {"lookup": [4, 6, 8]})
    speculation.observe(plain_step, 0, [4], 1.0)  # one position seen, agreed
    speculation.observe(plain_step, 0, [9], 1.0)  # disagreed at once
    assert (policy.accepted, policy.rejected) == (2.0, 2.0)


@pytest.mark.parametrize("kernel", ["slot", "dedup", "auto"])
def test_greedy_auto_speculation_equals_plain_greedy(pair, kernel):
    target, draft = pair
    plain = tokens_of(generate(target, PROMPT, max_tokens=40, kernels=KernelPolicy(kernel)))
    drafters = [PromptLookupDrafter(), ModelDrafter(draft, Sampler(), target.config.vocab_size)]
    speculation = Speculation.auto(drafters, prior=(9.0, 1.0), probe_interval=4)
    records = list(
        generate(target, PROMPT, max_tokens=40, kernels=KernelPolicy(kernel), drafter=speculation)
    )
    assert tokens_of(records) == plain
    decode = records[1:]
    assert all((r.drafter is None) == (r.drafted == 0) for r in decode)
    assert {r.drafter for r in decode} <= {None, "lookup", "model"}
    assert {r.drafter for r in decode} > {None}  # something drafted


def test_plain_steps_run_no_draft_model_pass(pair):
    target, draft = pair
    counted = CountingModel(draft)
    drafter = ModelDrafter(counted, Sampler(), target.config.vocab_size)
    policy = DraftLengthPolicy("auto", step_times=LOSS, prior=(1.0, 9.0), probe_interval=8)
    records = list(
        generate(target, PROMPT, max_tokens=60, drafter=Speculation.single(drafter, policy))
    )
    assert all(r.drafted == 0 for r in records[1:])  # drafting never pays on these V(k)
    # The first look (a catch-up pass over the last 16 tokens, one timed one-token pass) at
    # step 0; greedy probes (the same two passes, each costing far under the budget's share
    # of V(0) = 1 s) due after 8, then 16, 32 plain steps, run at the first choice then: a
    # plain streak chooses at steps 0, 2, 6, 14, then every 8 (QUIET_MAX_GAP), so at steps
    # 14 and 30 (the third would be at 62).
    assert counted.passes == 2 + 2 * 2
    plain = tokens_of(generate(target, PROMPT, max_tokens=60))
    assert tokens_of(records) == plain


def test_paired_rounds_alternate_their_order_and_report_the_median_ratio(pair):
    target, draft = pair

    def plain_arm(n):
        return generate(target, PROMPT, max_tokens=n)

    def speculative_arm(n):
        drafter = ModelDrafter(draft, Sampler(), target.config.vocab_size)
        return generate(
            target, PROMPT, max_tokens=n, drafter=drafter, draft_policy=DraftLengthPolicy(2)
        )

    shown = []
    comparison, records = compare_plain(
        speculative_arm, plain_arm, 12, rounds=4, on_speculative=shown.append
    )
    assert [r.plain_first for r in comparison.rounds] == [False, True, False, True]
    assert comparison.same_tokens and shown == records
    ratios = sorted(r.tokens_per_second / r.plain_tokens_per_second for r in comparison.rounds)
    assert comparison.speedup == pytest.approx((ratios[1] + ratios[2]) / 2)
    with pytest.raises(ValueError, match="rounds"):
        compare_plain(speculative_arm, plain_arm, 12, rounds=0)


def test_compare_plain_without_a_draft_compares_plain_with_itself(checkpoint_dir, capsys):
    import json

    directory, _ = checkpoint_dir("qwen3_moe")
    argv = ["generate", "--model", str(directory), "w1 w2 w3", "--max-tokens", "8"]
    assert main([*argv, "--dtype", "fp32", "--compare-plain", "--rounds", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["compare"]["rounds"]) == 3 and result["same_tokens_as_plain"] is True
    assert all(s["drafted"] == 0 for s in result["steps"])
    assert main([*argv, "--compare-plain", "--rounds", "0"]) == 2
    assert "argument --rounds: must be >= 1, got 0" in capsys.readouterr().err


def test_auto_draft_with_a_model_directory_on_the_command_line(checkpoint_dir, capsys):
    import json

    target, _ = checkpoint_dir("qwen3_moe")
    draft, _ = checkpoint_dir("qwen3")
    argv = ["generate", "--model", str(target), "w1 w2 w3 w1 w2", "--max-tokens", "24"]
    assert main([*argv, "--dtype", "fp32", "--draft", f"auto:{draft}", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    plain = main([*argv, "--dtype", "fp32", "--draft", "none", "--json"])
    assert plain == 0
    assert result["tokens"] == json.loads(capsys.readouterr().out)["tokens"]
    drafters = {s["drafter"] for s in result["steps"] if s["phase"] == "decode"}
    assert drafters <= {None, "suffix", "lookup", "model"}


def test_generate_is_batch_invariant_by_default_and_says_so(checkpoint_dir, capsys):
    import json

    directory, _ = checkpoint_dir("qwen3_moe")
    argv = ["generate", "--model", str(directory), "w1 w2", "--max-tokens", "3", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["batch_invariant"] is True
    assert main([*argv, "--batch-invariant", "off"]) == 0
    assert json.loads(capsys.readouterr().out)["batch_invariant"] is False


def test_the_policy_s_float_choice_is_the_cost_model_s_exactly():
    import random

    from moespec.costmodel import best_draft_length, throughput
    from moespec.decoding.draft_policy import _best_in_floats

    rng = random.Random(0)
    for _ in range(2000):
        n = rng.randint(1, 9)
        table = [rng.uniform(0.1, 3.0) for _ in range(n)]
        if rng.random() < 0.2:  # ties and flat tables, where the smaller k must win
            table = [table[0]] * n
        a = rng.choice([0.0, 0.5, 0.999, rng.random() * 0.999])
        k, value = _best_in_floats(table, a)
        assert k == best_draft_length(table, a)
        assert value == throughput(table, a, k)


def test_a_long_catch_up_restarts_the_draft_on_the_context_s_last_tokens(pair):
    target, draft = pair
    drafter = ModelDrafter(draft, Sampler(), target.config.vocab_size, max_catch_up=8)
    context = list(range(3, 23))  # 20 tokens: the first feed (a prompt) is whole
    assert drafter.catch_up(context) == (20, 0)
    context += list(range(30, 60))  # 30 missed tokens
    assert drafter.catch_up(context)[0] == 8 and drafter.offset == len(context) - 8
    context += [61, 62]
    assert drafter.catch_up(context)[0] == 2  # steady again: the window is not fed twice
    fresh = ModelDrafter(draft, Sampler(), target.config.vocab_size, max_catch_up=None)
    fresh.catch_up(context[drafter.offset :])  # the draft sees exactly the window
    # (fed as 8 + 2 tokens against 10 at once: fp32 passes of other sizes round apart)
    torch.testing.assert_close(drafter.next_logits, fresh.next_logits, rtol=1e-5, atol=1e-5)
    # and the target's output stays the plain greedy one whatever the draft saw
    prompt = PROMPT * 2
    plain = tokens_of(generate(target, prompt, max_tokens=40))
    short = ModelDrafter(draft, Sampler(), target.config.vocab_size, max_catch_up=2)
    speculative = generate(
        target, prompt, max_tokens=40, drafter=short, draft_policy=DraftLengthPolicy(3)
    )
    assert tokens_of(speculative) == plain


def test_noisy_verify_times_never_make_a_longer_pass_cheaper():
    policy = DraftLengthPolicy("auto", max_draft_length=4)
    for seconds in (9.0, 1.0):
        policy.observe(0, 0, 0, seconds, 0.0)  # tau(1) = 1 (the first sample dropped)
    for seconds in (9.0, 0.6):
        policy.observe(1, 1, 1, seconds, 0.0)  # tau(2) = 0.6: noise, not a cheaper pass
    table = policy.step_times()
    # linearly, tau(5) would be 1 - 4 * 0.4 < 0 (then 1e-9: a free far draft)
    assert table == sorted(table) and min(table) >= 1.0


def test_a_drafter_whose_only_draft_time_was_dropped_is_not_free():
    policy = DraftLengthPolicy("auto", max_draft_length=4)
    for seconds in (9.0, 1.0):
        policy.observe(0, 0, 0, seconds, 0.0)
    for seconds in (9.0, 1.5):
        policy.verify_times.add(2, seconds)  # tau(2) measured (another drafter's steps)
    policy.observe_draft(2, 1, 0.4)  # one draft of 2 tokens: its time is a first sample
    table = policy.step_times()
    # h(k) provisional at k * 0.2 (the dropped sample's rate), not 0
    assert table[4] == pytest.approx(1.0 + 4 * 0.5 + 4 * 0.2)


def test_a_draft_step_that_caught_up_counts_as_the_steady_step_in_it():
    policy = DraftLengthPolicy("auto", max_draft_length=4)
    for _ in range(2):  # the first sample of each length is dropped
        # 30 tokens beyond a steady feed of 2 in 0.032 s, then 0.01 s of drafting
        policy.observe_draft(3, 3, 0.042, catch_up=30, catch_up_seconds=0.032)
    assert policy.draft_times.known() == {3: pytest.approx(0.01 + 0.032 * 2 / 32)}


def test_a_plain_streak_skips_the_choice_at_doubling_gaps_up_to_eight(pair):
    from moespec.decoding.speculation import QUIET_MAX_GAP

    target, draft = pair
    drafter = PromptLookupDrafter()
    speculation = Speculation.single(drafter, DraftLengthPolicy("auto", step_times=LOSS))
    chose = []
    original = speculation._choose

    def spy(context, limit):
        chose.append(len(context))
        return original(context, limit)

    speculation._choose = spy
    prompt = list(range(3, 13))  # no repeated n-gram: lookup proposes nothing, steps stay plain
    records = list(generate(target, prompt, max_tokens=40, drafter=speculation))
    steps = [n - len(prompt) - 1 for n in chose]
    assert steps == [0, 2, 6, 14, 22, 30] and QUIET_MAX_GAP == 8  # (38: no room to draft)
    assert all(r.drafted == 0 for r in records[1:])


def test_a_greedy_model_drafter_first_looks_before_it_drafts(pair):
    from moespec.decoding.speculation import FIRST_LOOK

    target, draft = pair
    counted = CountingModel(draft)
    model = ModelDrafter(counted, Sampler(), target.config.vocab_size)
    speculation = Speculation.auto([model], prior=(2.0, 2.0))  # no cheap drafter to wait for
    context = list(range(3, 43))  # 40 tokens
    proposal = speculation.propose(context, 8)
    policy = speculation.policies["model"]
    assert FIRST_LOOK == 16 and counted.passes == 2  # the look's catch-up, one timed pass
    assert model.offset == len(context) - FIRST_LOOK  # not the whole 40-token prompt
    assert model.cached[:-1] == context[-FIRST_LOOK:]  # and one greedy token ahead
    assert policy.observations == FIRST_LOOK - 1  # every fed position scored
    assert 1 in policy.draft_times.first and policy.probe_seconds > 0  # h(1), the look's cost
    assert proposal.drafter is None  # tau(2) unknown: no draft before a warm-up
    # The token ahead is kept when the context continues with it, rolled back when not.
    ahead = model.cached[-1]
    assert model.catch_up([*context, ahead]) == (0, 0)
    other = (ahead + 1) % target.config.vocab_size
    assert model.catch_up([*context, other])[0] == 1  # `other` replaces the token ahead
    fresh = ModelDrafter(draft, Sampler(), target.config.vocab_size, max_catch_up=None)
    fresh.catch_up([*context, other][model.offset :])
    torch.testing.assert_close(model.next_logits, fresh.next_logits, rtol=1e-5, atol=1e-5)


def test_a_model_s_warm_up_waits_for_the_cheap_drafter_to_measure_pass_sizes(pair):
    from moespec.decoding.speculation import WARM_UP_WAIT

    target, draft = pair
    model = ModelDrafter(draft, Sampler(), target.config.vocab_size)
    speculation = Speculation.auto([PromptLookupDrafter(), model], prior=(9.0, 1.0))
    context = list(range(3, 13))
    chosen = []
    for token in range(13, 13 + WARM_UP_WAIT + 1):  # no repeated n-gram: lookup has nothing
        proposal = speculation._choose(context, 8)
        chosen.append(proposal.drafter)
        speculation.observe(proposal, 0, [token], 0.001)
        context.append(token)
    # Pass size 2 is unmeasured, so the (optimistic) model would warm up at once; it waits
    # WARM_UP_WAIT choices for lookup, which a pass of 2 tokens would cost the same.
    assert chosen[:WARM_UP_WAIT] == [None] * WARM_UP_WAIT and chosen[-1] == "model"


def test_a_plain_step_that_skips_the_choice_only_counts_as_idle():
    speculation = Speculation.single(
        PromptLookupDrafter(), DraftLengthPolicy("auto", step_times=LOSS)
    )
    policy = speculation.policies["lookup"]
    context = list(range(3, 13))
    chosen = speculation.propose(context, 8)  # chosen: plain (LOSS), the streak starts
    speculation.observe(chosen, 0, [20], 1.0)
    speculation.observe(chosen, 0, [21], 1.0)  # tau(1) recorded (its first sample dropped)
    skipped = speculation.propose(context, 8)
    assert skipped is speculation.unchosen and skipped.drafter is None
    idle = policy.idle_streak
    speculation.observe(skipped, 0, [22], 9.0)
    assert policy.idle_streak == idle + 1
    assert speculation.verify_times.known() == {1: 1.0}  # the skipped step's 9 s not taken


def test_the_first_look_waits_for_verify_times_and_is_priced_when_bytes_rule_the_draft_out(pair):
    from moespec.decoding.draft_policy import HOPELESS_BUDGET
    from moespec.decoding.speculation import FIRST_LOOK, WARM_UP_WAIT

    target, draft = pair
    model = ModelDrafter(draft, Sampler(), target.config.vocab_size)
    speculation = Speculation.auto([PromptLookupDrafter(), model], prior=(2.0, 2.0))
    option = speculation.options["model"]
    policy = option.policy
    assert not speculation._look_due(option)  # tau(n) unknown, and lookup can measure it
    speculation.choices = WARM_UP_WAIT + 1
    assert speculation._look_due(option)  # lookup had its chances
    speculation.choices = 0
    for n in range(1, 10):
        for _ in range(2):  # (the first sample of each size is dropped)
            speculation.verify_times.add(n, 1.0 + 0.5 * (n - 1))
    # A draft of 0.6 the target's bytes: h(k) = 0.6 k s. At the optimistic acceptance of
    # Beta(2, 2), 0.5 + 2 * 0.2236 = 0.947, one draft gives 1.947 / (1.5 + 0.6) < 1 token
    # a second and eight (1 - 0.947^9) / 0.053 = 7.1 / (5 + 4.8) < 1: the bytes rule it out.
    policy.draft_byte_ratio = 0.6
    assert policy.step_times()[1] == pytest.approx(2.1) and policy.hopeless(policy.step_times())
    # So the look is a hopeless probe of 16 draft steps (9.6 s) at 0.5% of tau(1) = 1 s a
    # plain step: 1,920 plain steps.
    assert (FIRST_LOOK, HOPELESS_BUDGET) == (16, 0.005)
    policy.idle_streak = 1919
    assert not speculation._look_due(option)
    policy.idle_streak = 1920
    assert speculation._look_due(option)
    policy.idle_streak = 0
    policy.draft_byte_ratio = 0.05  # a draft this small could pay: look at once
    policy._table_key = None
    assert speculation._look_due(option)


def test_the_factory_gives_a_draft_model_its_byte_ratio(checkpoint_dir):
    from moespec.decoding.setup import speculation_factory

    target, tokenizer = load_model(checkpoint_dir("qwen3_moe")[0], dtype="fp32")
    draft_dir = checkpoint_dir("qwen3")[0]
    make = speculation_factory(
        f"auto:{draft_dir}",
        target=target,
        tokenizer=tokenizer,
        sampler=Sampler(),
        prompt=[1, 2, 3],
        max_tokens=8,
        dtype="fp32",
    )
    policies = make().policies
    draft = make.models["model"]
    assert policies["model"].draft_byte_ratio == draft.step_bytes() / target.step_bytes()
    assert policies["suffix"].draft_byte_ratio is None  # the suffix drafter reads no weights
    # one pass of one token: the dense bytes and top-k experts of each MoE layer
    c = target.config
    top_k = sum(c.top_k * b.experts.bytes_per_expert for b in target.moe_blocks.values())
    assert target.step_bytes() == target.parameter_bytes()["dense"] + top_k > top_k


def test_a_median_that_moves_by_microseconds_keeps_the_tables():
    from moespec.decoding.draft_policy import RETABLE_SECONDS, RunningMedians

    medians = RunningMedians()
    for seconds in (1e-5, 1e-5, 1e-5):  # lookup's h(1): 10 us (the first sample dropped)
        medians.add(1, seconds)
    version = medians.version
    medians.add(1, 1.3e-5)
    medians.add(1, 1.3e-5)  # median 11.5 us: 15% up, but 1.5 us, under RETABLE_SECONDS
    assert RETABLE_SECONDS == 2e-6 and medians.version == version
    assert medians.known() == {1: 1e-5}
    medians.add(1, 1.3e-5)
    medians.add(1, 1.3e-5)  # median 13 us: 3 us up
    assert medians.version > version and medians.known() == {1: 1.3e-5}


def test_the_server_gives_a_draft_model_its_byte_ratio_too(checkpoint_dir):
    from moespec.decoding.setup import draft_byte_ratio
    from moespec.serve.speculation import build_speculation

    target, tokenizer = load_model(checkpoint_dir("qwen3_moe")[0], dtype="fp32")
    draft_dir = checkpoint_dir("qwen3")[0]
    speculation = build_speculation(
        f"auto:{draft_dir}", target=target, tokenizer=tokenizer, dtype="fp32"
    )
    policies = speculation.drafter(Sampler(), [1, 2, 3], 8, seed=0).policies
    ratio = draft_byte_ratio(speculation.draft_model, target)
    assert policies["model"].draft_byte_ratio == ratio and ratio > 0
    assert policies["suffix"].draft_byte_ratio is None
