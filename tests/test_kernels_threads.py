"""The thread policy: small work on one thread inside a pass, the caller's setting restored."""

import pytest
import torch

from moespec.kernels.threads import (
    SMALL_WORK_BYTES,
    pass_threads,
    product_threads,
    threads_for,
)


@pytest.fixture
def two_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


def test_small_work_gets_one_thread_and_large_work_all():
    assert threads_for(SMALL_WORK_BYTES - 1, available=4) == 1
    assert threads_for(SMALL_WORK_BYTES, available=4) == 4


def test_a_small_pass_runs_on_one_thread_and_restores_the_setting(two_threads):
    with pass_threads(1024):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2


def test_products_in_a_pass_follow_their_size_whatever_the_pass_runs_on(two_threads):
    with pass_threads(1024):
        assert product_threads(SMALL_WORK_BYTES // 4, rows=1) == 1
        assert product_threads(SMALL_WORK_BYTES // 4, rows=4) == 2
    assert product_threads(SMALL_WORK_BYTES, rows=1) is None  # outside a pass: left alone


def test_a_pass_restores_the_setting_when_it_raises(two_threads):
    with pytest.raises(RuntimeError), pass_threads(1024):
        raise RuntimeError("boom")
    assert torch.get_num_threads() == 2


def test_a_model_pass_gives_the_same_logits_on_one_and_two_threads(checkpoint_dir, two_threads):
    from moespec.models import load_model

    directory, _ = checkpoint_dir("qwen3_moe")
    model, _ = load_model(directory, dtype="fp32")
    tokens = torch.tensor([3, 1, 4, 1, 5])
    two = model(tokens, model.new_cache(), all_logits=True)
    torch.set_num_threads(1)
    one = model(tokens, model.new_cache(), all_logits=True)
    assert torch.equal(one, two)
    assert model.thread_plan()["available"] == 1
