"""Launching the Triton expert kernels: buffers, grids and settings (imports Triton).

Both kernels take the expert-kernel signature plus optional launch settings:

    kernel(x [T, H], expert_ids [T, m], expert_weights [T, m], experts, settings=None) -> y [T, H]

A pass is planned as a list of launches, then run. Nothing synchronises with the host (the
deduplicating kernel finds the pass's distinct experts on the device), so a pass can be captured
in a CUDA graph.
"""

import functools
from typing import NamedTuple

import torch
import triton

from moespec.kernels.experts import ExpertWeights
from moespec.kernels.triton import jit
from moespec.kernels.triton.settings import KernelSettings, StageSettings, settings_for

# Tokens of one dedup tile: tensor-core products need 16 rows; more would need a loop over tiles.
DEDUP_TOKENS = 16
SORT_CHUNK = 16  # slots compared at a time when the dedup kernel sorts the pass's experts
SUM_BLOCK = 1024


class Launch(NamedTuple):
    kernel: object  # a @triton.jit function
    grid: tuple[int, ...]
    args: tuple
    meta: dict  # constexpr arguments and Triton launch options


def run(launches: list[Launch]) -> None:
    for launch in launches:
        launch.kernel[launch.grid](*launch.args, **launch.meta)


def _settings(kernel: str, x: torch.Tensor, experts: ExpertWeights) -> KernelSettings:
    device = torch.cuda.get_device_name(x.device) if x.is_cuda else None
    return _tuned(kernel, experts.hidden_size, experts.intermediate_size, device)


@functools.cache
def _tuned(kernel: str, hidden: int, inter: int, device: str | None) -> KernelSettings:
    # Looked up once per shape and device: a pass's host time matters at batch one.
    return settings_for(kernel, hidden, inter, device)


def _meta(stage: StageSettings, x: torch.Tensor, **constexprs) -> dict:
    """A stage's tile sizes, its other constexprs and Triton's launch options."""
    return {
        "BLOCK_N": stage.block_n,
        "BLOCK_K": stage.block_k,
        "STAGES": stage.num_stages,
        "WIDEN": jit.INTERPRET or x.dtype == torch.float32,
        **constexprs,
        "num_warps": stage.num_warps,
        "num_stages": stage.num_stages,
    }


def _inputs(x, expert_ids, expert_weights, experts):
    if x.dtype != experts.dtype:
        raise ValueError(f"activations are {x.dtype} but expert weights are {experts.dtype}")
    for name, w in (("gate_up", experts.gate_up), ("down", experts.down)):
        if w.stride(-1) != 1:
            raise ValueError(f"expert {name} weights need unit stride along their last dimension")
    # x [T, H], ids [T, m] (int64 as routed), weights [T, m] fp32: no-ops when already so
    return x.contiguous(), expert_ids.contiguous(), expert_weights.float().contiguous()


def _down_output(x: torch.Tensor, split: int) -> torch.Tensor:
    """Where a down stage writes: y itself, or fp32 partials [split, T, H] to be summed."""
    if split == 1:
        return torch.empty_like(x)
    return x.new_empty((split, *x.shape), dtype=torch.float32)


def _finish(out: torch.Tensor, x: torch.Tensor, launches: list[Launch]) -> torch.Tensor:
    """y: the down stage's output, or its partials [SPLIT, T, H] summed in split order."""
    if out.dim() == 2:
        return out
    y = torch.empty_like(x)
    grid = (triton.cdiv(y.numel(), SUM_BLOCK),)
    meta = {"SPLIT": out.shape[0], "BLOCK": SUM_BLOCK}
    launches.append(Launch(jit.sum_partials_kernel, grid, (out, y, y.numel()), meta))
    return y


def plan_slot(x, expert_ids, expert_weights, experts, settings=None):
    """(launches, y) of a per-slot pass; y holds the result once the launches have run."""
    x, ids, weights = _inputs(x, expert_ids, expert_weights, experts)
    settings = settings or _settings("slot", x, experts)
    (tokens, top_k), hidden, inter = ids.shape, experts.hidden_size, experts.intermediate_size
    gate_up, down = experts.gate_up, experts.down
    act = x.new_empty(tokens * top_k, inter)  # [S, I]
    stage = settings.gate_up
    launches = [
        Launch(
            jit.slot_gate_up_kernel,
            (triton.cdiv(inter, stage.block_n), tokens * top_k),
            (x, ids, gate_up, act, top_k, hidden, inter, gate_up.stride(0), gate_up.stride(1)),
            _meta(stage, x),
        )
    ]
    stage = settings.down
    split = min(stage.split, top_k)
    out = _down_output(x, split)
    launches.append(
        Launch(
            jit.slot_down_kernel,
            (triton.cdiv(hidden, stage.block_n), tokens, split),
            (
                act,
                ids,
                weights,
                down,
                out,
                tokens,
                top_k,
                hidden,
                inter,
                down.stride(0),
                down.stride(1),
            ),
            _meta(stage, x, SPLIT=split),
        )
    )
    return launches, _finish(out, x, launches)


def plan_dedup(x, expert_ids, expert_weights, experts, settings=None):
    """(launches, y) of a deduplicating pass of 2..16 tokens."""
    x, ids, weights = _inputs(x, expert_ids, expert_weights, experts)
    settings = settings or _settings("dedup", x, experts)
    (tokens, top_k), hidden, inter = ids.shape, experts.hidden_size, experts.intermediate_size
    if not 2 <= tokens <= DEDUP_TOKENS:
        raise ValueError(f"the Triton dedup kernel takes 2..{DEDUP_TOKENS} tokens, got {tokens}")
    gate_up, down = experts.gate_up, experts.down
    slots = tokens * top_k
    padded = {"BLOCK_T": DEDUP_TOKENS, "M_PAD": triton.next_power_of_2(top_k)}
    act = x.new_empty(slots, inter)  # [S, I]; rows of first slots only are written and read
    distinct = torch.empty(1 + slots, dtype=torch.int32, device=x.device)  # [U, e_0, e_1, ...]
    # At most min(S, E) distinct experts: more splits would only add idle programs.
    most_distinct = min(slots, experts.num_experts)
    stage = settings.gate_up
    split = min(stage.split, most_distinct)
    sort = {"S_PAD": max(triton.next_power_of_2(slots), SORT_CHUNK), "CHUNK": SORT_CHUNK}
    launches = [
        Launch(
            jit.dedup_gate_up_kernel,
            (triton.cdiv(inter, stage.block_n), split),
            (
                x,
                ids,
                gate_up,
                act,
                distinct,
                tokens,
                top_k,
                hidden,
                inter,
                gate_up.stride(0),
                gate_up.stride(1),
            ),
            _meta(stage, x, SPLIT=split, **padded, **sort),
        )
    ]
    stage = settings.down
    split = min(stage.split, most_distinct)
    out = _down_output(x, split)
    launches.append(
        Launch(
            jit.dedup_down_kernel,
            (triton.cdiv(hidden, stage.block_n), split),
            (
                act,
                ids,
                weights,
                down,
                distinct,
                out,
                tokens,
                top_k,
                hidden,
                inter,
                down.stride(0),
                down.stride(1),
            ),
            _meta(stage, x, SPLIT=split, **padded),
        )
    )
    return launches, _finish(out, x, launches)


def slot_experts_triton(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    experts: ExpertWeights,
    settings: KernelSettings | None = None,
) -> torch.Tensor:
    """Per-slot: every (token, slot) reads its expert's weights; n m expert reads per pass."""
    launches, y = plan_slot(x, expert_ids, expert_weights, experts, settings)
    run(launches)
    return y


def dedup_experts_triton(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    experts: ExpertWeights,
    settings: KernelSettings | None = None,
) -> torch.Tensor:
    """Deduplicating: each distinct expert of the pass read once, applied to all its tokens.

    A one-token pass has nothing to deduplicate (a token's top-k experts are distinct): it runs
    the per-slot kernel.
    """
    if expert_ids.shape[0] == 1:
        return slot_experts_triton(x, expert_ids, expert_weights, experts)
    launches, y = plan_dedup(x, expert_ids, expert_weights, experts, settings)
    run(launches)
    return y
