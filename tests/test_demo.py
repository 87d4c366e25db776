"""The embedded demo pair, checked with moespec's own engine on held-out standard-library text
(the training script measured the same things with transformers; these are independent)."""

import json
import math

import numpy as np
import pytest
import torch

from moespec.decoding import DraftLengthPolicy, ModelDrafter, Sampler, generate
from moespec.demo import DEMO_DIR, demo_paths
from moespec.demo.corpus import held_out_documents
from moespec.models import load_model


@pytest.fixture(scope="module")
def pair():
    target, draft = demo_paths()
    return load_model(target, dtype="fp32"), load_model(draft, dtype="fp32")[0]


@pytest.fixture(scope="module")
def held_out(pair):
    (_, tokenizer), _ = pair
    docs = list(held_out_documents())
    return [tokenizer.encode(d.text) for d in docs]


def test_demo_pair_is_a_qwen3_moe_target_and_a_dense_draft_sharing_a_tokenizer(pair):
    (target, tokenizer), draft = pair
    assert target.config.model_type == "qwen3_moe" and target.config.num_experts == 16
    assert target.config.top_k == 2 and draft.config.model_type == "qwen3"
    _, draft_tokenizer = load_model(demo_paths()[1], dtype="bf16")
    assert tokenizer.same_vocabulary(draft_tokenizer)
    sizes = sum(p.stat().st_size for p in DEMO_DIR.glob("*/model.safetensors"))
    assert sizes <= 40e6


@pytest.mark.parametrize(
    "prompt",
    ["def fibonacci(n):", "import os\n\ndef main():", "class Stack:\n    def push(self, x):"],
)
def test_demo_continues_a_python_header_with_an_indented_body(pair, prompt):
    # What a user sees first: after a def or class header, the next line is indented code
    # made of Python tokens, not noise.
    import keyword
    import re

    (target, tokenizer), _ = pair
    ids = tokenizer.encode(prompt)
    text = tokenizer.decode([t for r in generate(target, ids, max_tokens=32) for t in r.tokens])
    indent = len(prompt.splitlines()[-1]) - len(prompt.splitlines()[-1].lstrip())
    first = text.split("\n")[1] if text.startswith("\n") else ""
    assert first.startswith(" " * (indent + 4)), repr(text)
    words = re.findall(r"[A-Za-z_]+", text)
    assert '"""' in text or any(keyword.iskeyword(w) for w in words), repr(text)  # doc or code
    assert text.isascii() and all(c.isprintable() or c in "\n\t" for c in text), repr(text)


@pytest.mark.parametrize("k", [1, 3, 8, "auto"])
def test_greedy_speculative_output_equals_plain_greedy_on_the_demo_pair(pair, held_out, k):
    (target, _), draft = pair
    for prompt in (held_out[0][:40], held_out[3][:40]):
        plain = [t for r in generate(target, prompt, max_tokens=40) for t in r.tokens]
        drafter = ModelDrafter(draft, Sampler(), target.config.vocab_size)
        spec = [
            t
            for r in generate(
                target, prompt, max_tokens=40, drafter=drafter, draft_policy=DraftLengthPolicy(k)
            )
            for t in r.tokens
        ]
        assert spec == plain


def test_held_out_loss_is_far_below_the_unigram_baseline(pair, held_out):
    (target, _), _ = pair
    log = json.loads((DEMO_DIR / "training_log.json").read_text())
    unigram = log["eval"]["unigram_loss"]
    tokens = torch.tensor([t for doc in held_out[:6] for t in doc[:512]])
    losses = []
    for doc in held_out[:6]:
        ids = torch.tensor(doc[:512])
        logits = target(ids, target.new_cache(capacity=512), all_logits=True, kernel="dedup")[0]
        losses.append(torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="sum"))
    loss = float(sum(losses)) / (len(tokens) - len(losses))
    assert loss < unigram - 1.5
    assert loss < math.log(target.config.vocab_size) - 3


def test_routing_shows_temporal_locality_and_balanced_experts(pair):
    from moespec.routing.record import record_trace
    from moespec.routing.reuse import reuse_report

    (target, tokenizer), _ = pair
    trace = record_trace(target, tokenizer, held_out_documents(12, 8000), truncate="right")
    report = reuse_report(trace, max_n=2, bootstrap=200, seed=0)
    measured = report.measured.reuse_mean[1]
    random_high = report.random_pairing.intervals["reuse_mean"][1][1]
    uniform = target.config.top_k / target.config.num_experts
    assert measured > random_high and measured > uniform + 0.05
    for layer in range(trace.num_layers):
        counts = np.bincount(trace.expert_ids[:, layer].ravel(), minlength=16)
        assert counts.max() / counts.sum() < 3 / 16  # no expert above 3x its fair share


def test_greedy_acceptance_of_the_draft_is_above_0_4(pair, held_out):
    (target, _), draft = pair
    agree = total = 0
    for doc in held_out[:8]:
        prompt = doc[:64]
        continuation = [t for r in generate(target, prompt, max_tokens=32) for t in r.tokens]
        context = torch.tensor(prompt + continuation)
        logits = draft(context, draft.new_cache(capacity=len(context)), all_logits=True)[0]
        predicted = logits.argmax(-1)[len(prompt) - 1 : -1].tolist()
        agree += sum(p == t for p, t in zip(predicted, continuation, strict=True))
        total += len(continuation)
    assert agree / total > 0.4


def test_greedy_speculation_equals_plain_greedy_in_bf16_on_held_out_prompts():
    # The default dtype: a batch-invariant target makes a pass of k + 1 tokens give each
    # token the bits of a pass of one, so no near-tie can send speculation another way.
    from moespec.decoding.setup import speculation_factory

    target, tokenizer = load_model(demo_paths()[0], dtype="bf16")
    target.batch_invariant = True
    prompts = [tokenizer.encode(d.text)[:48] for d in held_out_documents(6, 3000)]
    for prompt in prompts:
        plain = [t for r in generate(target, prompt, max_tokens=64) for t in r.tokens]
        for spec, k in ((f"auto:{demo_paths()[1]}", "auto"), (str(demo_paths()[1]), 6)):
            make = speculation_factory(
                spec,
                draft_length=k,
                target=target,
                tokenizer=tokenizer,
                sampler=Sampler(),
                prompt=prompt,
                max_tokens=64,
                dtype="bf16",
            )
            records = generate(target, prompt, max_tokens=64, drafter=make())
            assert [t for r in records for t in r.tokens] == plain, (spec, k)
