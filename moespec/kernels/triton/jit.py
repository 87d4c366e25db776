"""Triton kernels of the expert operation of one verification pass (seed 000 §2).

T = tokens of the pass (<= 16), m = slots per token, S = T m slots, E = experts, H = hidden,
I = expert intermediate size; gate_up [E, 2I, H] (rows [:I] gate, [I:] up), down [E, H, I].
Both kernels run the same pipeline in two stages: (gate, up) -> SwiGLU, then down -> combine.

per-slot   gate_up grid (I / BLOCK_N, S), slot-major: each slot reads rows of its own expert.
           down grid (H / BLOCK_N, T, SPLIT): a token's slots, SPLIT ways, weighted in registers.
dedup      gate_up grid (I / BLOCK_N, SPLIT): every program sorts the pass's experts on the device
           (a rank count over the S slots) and applies row blocks of each of its distinct experts
           to all of that expert's tokens at once; the weight tile is read once per pass.
           down grid (H / BLOCK_N, SPLIT): the same, with the routing-weighted combine per token.

The combine never uses atomics: with SPLIT = 1 a down program owns its output rows and writes
them; with SPLIT > 1 it writes fp32 partial sums [SPLIT, T, H] that `sum_partials_kernel` adds in
a fixed order. So every result is bitwise reproducible.
"""

import os

import triton
import triton.language as tl

# Read when the decorators below run, as Triton itself does.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _times_rows(a, w, BLOCK_T: tl.constexpr, WIDEN: tl.constexpr):
    """a [BLOCK_T, BLOCK_K] times w [BLOCK_N, BLOCK_K] transposed -> [BLOCK_T, BLOCK_N] in fp32.

    One token: a matrix-vector product. More: a tensor-core product; its token rows are padded
    only in registers (loads of tokens that are not the expert's are masked off).
    """
    if BLOCK_T == 1:
        out = tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    elif WIDEN:
        # fp32 weights, or the interpreter (it multiplies bf16 bit patterns as integers in
        # tl.dot); widening bf16 is exact, and "ieee" keeps fp32 from rounding to tf32.
        out = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    else:
        out = tl.dot(a, tl.trans(w))
    return out


@triton.jit
def _swiglu_rows(
    x_ptr,
    tokens,
    token_mask,
    w_ptr,
    rows,
    H,
    I,
    stride_row,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    WIDEN: tl.constexpr,
):
    """silu(gate) * up for gate rows `rows` of one expert (w_ptr at gate_up[e]) and the given
    tokens: [BLOCK_T, BLOCK_N] in fp32."""
    row_mask = rows < I
    gate = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, H, BLOCK_K, num_stages=STAGES):  # loads STAGES steps ahead
        cols = k0 + tl.arange(0, BLOCK_K)
        col_mask = cols < H
        a = tl.load(
            x_ptr + tokens[:, None] * H + cols[None, :],
            mask=token_mask[:, None] & col_mask[None, :],
            other=0.0,
        )  # [BLOCK_T, BLOCK_K]
        w_mask = row_mask[:, None] & col_mask[None, :]
        w_gate = tl.load(w_ptr + rows[:, None] * stride_row + cols[None, :], mask=w_mask, other=0.0)
        w_up = tl.load(
            w_ptr + (rows + I)[:, None] * stride_row + cols[None, :], mask=w_mask, other=0.0
        )
        gate += _times_rows(a, w_gate, BLOCK_T, WIDEN)
        up += _times_rows(a, w_up, BLOCK_T, WIDEN)
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _down_rows(
    act_ptr,
    act_rows,
    act_mask,
    w_ptr,
    rows,
    H,
    I,
    stride_row,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    WIDEN: tl.constexpr,
):
    """down[e][rows] @ act[act_rows] for one expert (w_ptr at down[e]): [BLOCK_T, BLOCK_N] fp32."""
    row_mask = rows < H
    out = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, I, BLOCK_K, num_stages=STAGES):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_mask = cols < I
        a = tl.load(
            act_ptr + act_rows[:, None] * I + cols[None, :],
            mask=act_mask[:, None] & col_mask[None, :],
            other=0.0,
        )  # [BLOCK_T, BLOCK_K]
        w = tl.load(
            w_ptr + rows[:, None] * stride_row + cols[None, :],
            mask=row_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        out += _times_rows(a, w, BLOCK_T, WIDEN)
    return out


@triton.jit
def _sorted_experts(ids_ptr, S, S_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """The pass's experts sorted once: (ids [S_PAD], first [S_PAD], rank [S_PAD]).

    first[p]: slot p is the first slot naming its expert; rank[p]: how many distinct experts are
    smaller than slot p's, so the first slots give the g-th distinct expert at rank g. Slots are
    compared CHUNK at a time, which bounds the registers of the [S_PAD, CHUNK] comparisons.
    """
    p = tl.arange(0, S_PAD)
    ids = tl.load(ids_ptr + p, mask=p < S, other=-1).to(tl.int32)
    first = p < S
    rank = tl.zeros((S_PAD,), dtype=tl.int32)
    for q0 in range(0, S_PAD, CHUNK):
        q = q0 + tl.arange(0, CHUNK)
        ids_q = tl.load(ids_ptr + q, mask=q < S, other=-1).to(tl.int32)
        seen = (ids[:, None] == ids_q[None, :]) & (q[None, :] < p[:, None])  # [S_PAD, CHUNK]
        first = first & (tl.max(seen.to(tl.int32), axis=1) == 0)
        # The same test for the chunk's own slots, then count the chunk's smaller first slots.
        seen_q = (ids_q[:, None] == ids[None, :]) & (p[None, :] < q[:, None])  # [CHUNK, S_PAD]
        first_q = (q < S) & (tl.max(seen_q.to(tl.int32), axis=1) == 0)
        smaller = first_q[None, :] & (ids_q[None, :] < ids[:, None])  # [S_PAD, CHUNK]
        rank += tl.sum(smaller.to(tl.int32), axis=1)
    return ids, first, rank


@triton.jit
def _members(ids_tile, e, tokens, slots, m, M_PAD: tl.constexpr):
    """Which tokens of the pass select expert e, and the slot of their first such selection."""
    match = ids_tile == e  # [BLOCK_T, M_PAD]
    has = tl.max(match.to(tl.int32), axis=1) > 0
    slot = tokens * m + tl.min(tl.where(match, slots[None, :], M_PAD), axis=1)
    return match, has, slot


@triton.jit
def slot_gate_up_kernel(
    x_ptr,
    ids_ptr,
    w_ptr,
    act_ptr,
    m,
    H,
    I,
    stride_e,
    stride_row,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    WIDEN: tl.constexpr,
):
    """act[s] = SwiGLU of slot s's expert on its token, one row block per program."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.program_id(1)
    expert = tl.load(ids_ptr + slot)
    one = tl.arange(0, 1)
    act = _swiglu_rows(
        x_ptr,
        one * 0 + slot // m,
        one == 0,
        w_ptr + expert * stride_e,
        rows,
        H,
        I,
        stride_row,
        1,
        BLOCK_N,
        BLOCK_K,
        STAGES,
        WIDEN,
    )  # [1, BLOCK_N]
    tl.store(
        act_ptr + slot * I + rows[None, :],
        act.to(act_ptr.dtype.element_ty),
        mask=(rows < I)[None, :],
    )


@triton.jit
def slot_down_kernel(
    act_ptr,
    ids_ptr,
    weights_ptr,
    w_ptr,
    out_ptr,
    T,
    m,
    H,
    I,
    stride_e,
    stride_row,
    SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    WIDEN: tl.constexpr,
):
    """out[split, t, rows] = sum over the token's slots k = split, split + SPLIT, ... of
    w[t, k] down[e_k][rows] @ act[t m + k]."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    token = tl.program_id(1)
    split = tl.program_id(2)
    one = tl.arange(0, 1)
    y = tl.zeros((1, BLOCK_N), dtype=tl.float32)
    for k in range(split, m, SPLIT):
        slot = token * m + k
        expert = tl.load(ids_ptr + slot)
        out = _down_rows(
            act_ptr,
            one * 0 + slot,
            one == 0,
            w_ptr + expert * stride_e,
            rows,
            H,
            I,
            stride_row,
            1,
            BLOCK_N,
            BLOCK_K,
            STAGES,
            WIDEN,
        )
        y += out * tl.load(weights_ptr + slot)
    tl.store(
        out_ptr + (split * T + token) * H + rows[None, :],
        y.to(out_ptr.dtype.element_ty),
        mask=(rows < H)[None, :],
    )


@triton.jit
def dedup_gate_up_kernel(
    x_ptr,
    ids_ptr,
    w_ptr,
    act_ptr,
    distinct_ptr,
    T,
    m,
    H,
    I,
    stride_e,
    stride_row,
    SPLIT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    M_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    WIDEN: tl.constexpr,
):
    """act[first slot of (t, e)] = SwiGLU of expert e on token t, for the distinct experts
    g = split, split + SPLIT, ... of the pass; also publishes [U, e_0, ..., e_{U-1}]."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    ids, first, rank = _sorted_experts(ids_ptr, T * m, S_PAD, CHUNK)
    num_distinct = tl.sum(first.to(tl.int32), axis=0)
    if (tl.program_id(0) == 0) & (split == 0):
        tl.store(distinct_ptr + 1 + rank, ids, mask=first)
        tl.store(distinct_ptr, num_distinct)
    tokens = tl.arange(0, BLOCK_T)
    slots = tl.arange(0, M_PAD)
    ids_tile = tl.load(
        ids_ptr + tokens[:, None] * m + slots[None, :],
        mask=(tokens < T)[:, None] & (slots < m)[None, :],
        other=-1,
    )
    for g in range(split, num_distinct, SPLIT):
        expert = tl.sum(tl.where(first & (rank == g), ids, 0), axis=0).to(tl.int64)
        _, has, slot = _members(ids_tile, expert, tokens, slots, m, M_PAD)
        act = _swiglu_rows(
            x_ptr,
            tokens,
            has,
            w_ptr + expert * stride_e,
            rows,
            H,
            I,
            stride_row,
            BLOCK_T,
            BLOCK_N,
            BLOCK_K,
            STAGES,
            WIDEN,
        )  # [BLOCK_T, BLOCK_N]
        tl.store(
            act_ptr + slot[:, None] * I + rows[None, :],
            act.to(act_ptr.dtype.element_ty),
            mask=has[:, None] & (rows < I)[None, :],
        )


@triton.jit
def dedup_down_kernel(
    act_ptr,
    ids_ptr,
    weights_ptr,
    w_ptr,
    distinct_ptr,
    out_ptr,
    T,
    m,
    H,
    I,
    stride_e,
    stride_row,
    SPLIT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    WIDEN: tl.constexpr,
):
    """out[split, t, rows] = sum over distinct experts g = split, split + SPLIT, ... of
    (sum of t's weights on e_g) down[e_g][rows] @ act[first slot of (t, e_g)]."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    tokens = tl.arange(0, BLOCK_T)
    slots = tl.arange(0, M_PAD)
    tile = tokens[:, None] * m + slots[None, :]
    tile_mask = (tokens < T)[:, None] & (slots < m)[None, :]
    ids_tile = tl.load(ids_ptr + tile, mask=tile_mask, other=-1)
    weights_tile = tl.load(weights_ptr + tile, mask=tile_mask, other=0.0)
    y = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for g in range(split, tl.load(distinct_ptr), SPLIT):
        expert = tl.load(distinct_ptr + 1 + g).to(tl.int64)
        match, has, slot = _members(ids_tile, expert, tokens, slots, m, M_PAD)
        weight = tl.sum(tl.where(match, weights_tile, 0.0), axis=1)  # [BLOCK_T]
        out = _down_rows(
            act_ptr,
            slot,
            has,
            w_ptr + expert * stride_e,
            rows,
            H,
            I,
            stride_row,
            BLOCK_T,
            BLOCK_N,
            BLOCK_K,
            STAGES,
            WIDEN,
        )
        y += out * weight[:, None]
    tl.store(
        out_ptr + (split * T + tokens)[:, None] * H + rows[None, :],
        y.to(out_ptr.dtype.element_ty),
        mask=(tokens < T)[:, None] & (rows < H)[None, :],
    )


@triton.jit
def sum_partials_kernel(partial_ptr, y_ptr, numel, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """y = sum over splits of partial [SPLIT, numel], added in split order (deterministic)."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in tl.static_range(SPLIT):
        total += tl.load(partial_ptr + split * numel + offsets, mask=mask, other=0.0)
    tl.store(y_ptr + offsets, total.to(y_ptr.dtype.element_ty), mask=mask)
