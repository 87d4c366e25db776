"""MiniMax-M2: what its tiny checkpoint exercises (score-correction bias, partial rotary) and
how its config is read. (Logits and generation parity run in test_models_parity.py.)"""

import dataclasses

import pytest
import torch

from moespec.models import load_config, load_model
from moespec.models.layers import Rotary
from tests.checkpoints import edit_config

pytest.importorskip("transformers")

TOKENS = torch.tensor([[5, 17, 33, 2, 90, 41, 7, 12, 60, 3, 3, 3, 44, 17, 5]])


def routing_of(model):
    seen = {}
    model(TOKENS, model.new_cache(), routing_sink=lambda i, ids, w: seen.__setitem__(i, ids))
    return seen


def test_the_score_correction_bias_changes_which_experts_are_chosen(checkpoint_dir):
    model, _ = load_model(checkpoint_dir("minimax_m2")[0], dtype="fp32")
    chosen = routing_of(model)
    for block in model.moe_blocks.values():
        block.correction_bias = None
    unbiased = routing_of(model)
    assert any(not torch.equal(chosen[i].sort().values, unbiased[i].sort().values) for i in chosen)


def test_only_the_rotary_dims_of_each_head_turn(checkpoint_dir):
    model, _ = load_model(checkpoint_dir("minimax_m2")[0], dtype="fp32")
    assert (model.config.rotary_dim, model.config.head_dim) == (8, 16)
    before = model(TOKENS, model.new_cache(), all_logits=True)
    model.rotary = Rotary(dataclasses.replace(model.config, rotary_dim=16))
    assert (model(TOKENS, model.new_cache(), all_logits=True) - before).abs().max() > 1e-3


def test_rotary_dim_and_partial_rotary_factor_read_alike(checkpoint_dir, tmp_path):
    import shutil

    directory = tmp_path / "factor"
    shutil.copytree(checkpoint_dir("minimax_m2")[0], directory)
    edit_config(directory, rotary_dim=None)  # left to rope_parameters.partial_rotary_factor
    assert load_config(directory).rotary_dim == 8
