"""The KV cache: rollback then re-decode equals never having gone forward; batch rows agree."""

import pytest
import torch

from moespec.models import load_model

TOKENS = torch.tensor([4, 8, 15, 16, 23, 42, 7, 7, 1, 30, 31, 2])


@pytest.fixture
def model(checkpoint_dir):
    directory, _ = checkpoint_dir("olmoe")
    return load_model(directory, dtype="fp32")[0]


def test_rollback_then_redecode_matches_never_going_forward(model):
    straight = model.new_cache()
    model(TOKENS[:6], straight)
    expected = model(TOKENS[6:9], straight, all_logits=True)

    rolled = model.new_cache()
    model(TOKENS[:6], rolled)
    model(torch.tensor([90, 91, 92, 93]), rolled, kernel="dedup")  # rejected drafts
    rolled.rollback(6)
    assert rolled.length == 6
    again = model(TOKENS[6:9], rolled, all_logits=True)
    assert torch.allclose(again, expected, atol=1e-6)


def test_rollback_beyond_length_is_refused(model):
    cache = model.new_cache()
    model(TOKENS[:3], cache)
    with pytest.raises(ValueError, match="cannot roll back to 5: the cache holds 3"):
        cache.rollback(5)


def test_batch_rows_match_single_sequences(model):
    other = torch.flip(TOKENS, [0])
    batch = model(torch.stack([TOKENS, other]), model.new_cache(batch=2), all_logits=True)
    alone = [model(t[None], model.new_cache(), all_logits=True)[0] for t in (TOKENS, other)]
    assert torch.allclose(batch[0], alone[0], atol=1e-5)
    assert torch.allclose(batch[1], alone[1], atol=1e-5)


def test_routing_sink_sees_every_moe_layer_and_token(model):
    seen = []
    model(
        TOKENS[:5],
        model.new_cache(),
        routing_sink=lambda layer, ids, w: seen.append((layer, tuple(ids.shape), float(w.sum()))),
    )
    assert [layer for layer, _, _ in seen] == [0, 1, 2]
    assert all(shape == (5, 2) for _, shape, _ in seen)


def test_logits_are_float32_whatever_the_weights(checkpoint_dir):
    directory, _ = checkpoint_dir("qwen3")
    model, _ = load_model(directory, dtype="bf16")
    assert model(TOKENS[:3], model.new_cache()).dtype == torch.float32
