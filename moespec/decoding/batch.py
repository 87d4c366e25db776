"""Continuous batching: many sequences decoding together, one target pass per step for all.

Each sequence is a `Decoding` (moespec.decoding.generate) with its own cache, sampler, drafter
and budget. A step plans every running sequence (its current token and its drafts), runs all
their tokens through the target in one batched pass (moespec.models.batch.batch_pass: each
sequence's rows attend over its own cache only, and every row gets the bits of its own
one-sequence pass), then verifies each sequence on its own rows. A finished sequence leaves at
once and the next waiting request joins (its prompt prefilled by a pass of its own), so the
batch stays full while there is work.

Exact: each sequence's tokens are those it decodes alone (greedy, keyed sampling; and, for
seeded unkeyed sampling, as long as its draws are the same), because its rows' logits are.
The expert kernel is chosen for the pass's total token count, where a batch's experts are
the union of its tokens' (seed 000's U(n) at larger n). A shared pass's time is not any one
sequence's tau(k + 1): it is tau(n) at the pass's n, observed by the kernel policy and the
speculation's tau table; each sequence's draft-length policy is told the batch size B and
prices k at its share tau(B (k + 1)) / B (`DraftLengthPolicy.batch`): k*(a, B).
"""

import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from moespec.decoding.adjust import LogitAdjust
from moespec.decoding.generate import Decoding, StepRecord
from moespec.decoding.kernel_policy import KernelPolicy
from moespec.decoding.sampling import Sampler
from moespec.models import Transformer

_END = object()


@dataclass
class BatchRequest:
    """One sequence of a batch. key: the caller's name for it (returned with its records);
    drafter: a Drafter or Speculation of its own (None: plain decoding)."""

    key: Any
    prompt: list[int]
    max_tokens: int
    sampler: Sampler = field(default_factory=Sampler)
    drafter: Any = None
    stop_tokens: tuple[int, ...] = ()
    adjust: LogitAdjust | None = None
    logprobs: int | None = None
    halt: threading.Event | None = None  # set: the sequence leaves before its next step


def decode_batch(
    model: Transformer,
    requests: Iterable[BatchRequest],
    *,
    max_batch: int,
    kernels: KernelPolicy | None = None,
) -> Iterator[tuple[Any, StepRecord]]:
    """Decode the requests with up to `max_batch` running at once; yield (key, record) for
    each record as it is made: a sequence's prefill record, then one per step it took part in,
    the last with its finish reason (or none, for a sequence whose `halt` was set). `requests`
    is read lazily, between steps, whenever the batch has room: an iterator may yield None for
    "none now" (the batch goes on with what runs), and may block while nothing runs."""
    from moespec.models.batch import batch_pass

    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    kernels = kernels or KernelPolicy()
    waiting = iter(requests)
    running: list[tuple[BatchRequest, Decoding]] = []
    more = True
    while True:
        while more and len(running) < max_batch:
            request = next(waiting, _END)
            if request is _END:
                more = False
            if request is None or request is _END:
                break
            decoding = start(model, request, kernels)
            yield request.key, decoding.start()
            if not decoding.done:
                running.append((request, decoding))
        running = [(r, d) for r, d in running if r.halt is None or not r.halt.is_set()]
        if not running:
            if not more:
                return
            continue
        for _, decoding in running:
            if decoding.speculation is not None:
                decoding.speculation.set_batch(len(running))
        feeds = [decoding.plan() for _, decoding in running]
        tokens = sum(map(len, feeds))
        kernel = kernels.for_pass(tokens)
        begin = time.perf_counter()
        caches = [decoding.cache for _, decoding in running]
        logits = batch_pass(model, feeds, caches, kernel=kernel, all_logits=True)
        shared = len(running) > 1  # alone, the sequence times its own pass, as generate does
        records = [
            decoding.finish(rows, kernel, shared=shared)
            for (_, decoding), rows in zip(running, logits, strict=True)
        ]
        if shared:  # the pass and every sequence's verification, as generate times a step's
            seconds = time.perf_counter() - begin
            kernels.observe(tokens, kernel, seconds)
            for table in verify_tables(running):  # tau(n) at the batch's n, once per table
                table.add(tokens, seconds)
        for (request, _), record in zip(running, records, strict=True):
            yield request.key, record
        running = [(request, decoding) for request, decoding in running if not decoding.done]


def start(model: Transformer, request: BatchRequest, kernels: KernelPolicy) -> Decoding:
    return Decoding(
        model,
        request.prompt,
        max_tokens=request.max_tokens,
        sampler=request.sampler,
        kernels=kernels,
        drafter=request.drafter,
        stop_tokens=request.stop_tokens,
        adjust=request.adjust,
        logprobs=request.logprobs,
    )


def verify_tables(running) -> list:
    """The distinct tau(n) tables of the running sequences' speculation (a server's requests
    share one: the target's pass time does not depend on who asked for it)."""
    tables = {}
    for _, decoding in running:
        if decoding.speculation is not None:
            table = decoding.speculation.verify_times
            tables[id(table)] = table
    return list(tables.values())
