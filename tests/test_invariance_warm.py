"""Batch invariance's one-time probes taken before decoding (`Transformer.warm_invariance`), not
inside the first verification pass whose time they would join."""

import pytest
import torch

from moespec.decoding import DraftLengthPolicy, OracleDrafter, generate
from moespec.decoding.setup import greedy_reference
from moespec.kernels import invariance
from moespec.models import load_model


@pytest.fixture
def probes(monkeypatch):
    """The probes taken from now on: a list of the probed weights' shapes (a fresh cache)."""
    taken, probe = [], invariance._probe
    monkeypatch.setattr(invariance, "_chunks", {})

    def counted(weight, product):
        taken.append(tuple(weight.shape))
        return probe(weight, product)

    monkeypatch.setattr(invariance, "_probe", counted)
    return taken


@pytest.fixture(scope="module")
def eager_int8(converted):
    model, _ = load_model(converted("int8"), pack_experts=False)
    model.native, model.batch_invariant = False, True
    return model


def test_warming_takes_every_probe_a_verification_pass_would(eager_int8, probes):
    model = eager_int8
    assert model.warm_invariance()
    warmed = list(probes)
    assert warmed, "the int8 projections of the eager pass are probed"
    probes.clear()
    with torch.inference_mode():
        model.forward(torch.arange(5), model.new_cache(capacity=8), all_logits=True)
    assert probes == []


def test_a_pass_not_warmed_probes_inside_it(eager_int8, probes):
    """The control: what warming moves out of the pass."""
    with torch.inference_mode():
        eager_int8.forward(torch.arange(5), eager_int8.new_cache(capacity=8), all_logits=True)
    assert probes


def test_speculative_generate_probes_before_its_first_record(eager_int8, probes):
    model, prompt = eager_int8, [3, 1, 4, 1, 5]
    reference = greedy_reference(model, prompt, 12)
    drafter = OracleDrafter(reference, len(prompt), 0.7, model.config.vocab_size, 0)
    stream = generate(
        model, prompt, max_tokens=12, drafter=drafter, draft_policy=DraftLengthPolicy(3)
    )
    records = [next(stream)]
    taken = len(probes)
    records += list(stream)
    assert taken and len(probes) == taken  # none inside the timed steps
    assert [t for r in records for t in r.tokens] == reference  # still the greedy tokens


def test_nothing_to_warm_without_batch_invariance_or_with_the_native_pass(converted, probes):
    model, _ = load_model(converted("int8"), pack_experts=False)
    model.native, model.batch_invariant = False, False
    assert not model.warm_invariance()
    model.batch_invariant = True
    model.native = True
    if model.native_step() is not None:
        assert not model.warm_invariance()
    assert probes == []
