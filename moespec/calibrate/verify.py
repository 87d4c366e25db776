"""Whole-model measurements the predictions never see: verify time per kernel and pass size,
and the draft model's time per step h(k).

A verification pass of n tokens runs at a context of `depth` tokens, teacher forced (the
pass's tokens are the text's next tokens); kernels and pass sizes are interleaved within each
repeat so slow drift of the machine spreads evenly, in a fresh random order each repeat
(`round_order`): in a fixed order the first pass of every round ran 12-22% slower than the same
pass later in the round (on the demo target, whose one-token pass takes 0.3 ms), which made the
per-slot kernel at n = 1 look slower than the identical deduplicating one.

How one pass is timed (`VERIFY_MODES`, `time_pass`): "stream" (the default) times the pass as
decoding runs it, in a run of consecutive passes of n tokens through the text centred on
`depth`, the first untimed, one value the median of the rest; "isolated" (the earlier reading)
times a single pass at `depth` and rolls it back, whatever pass of another size or kernel ran
just before. On a model whose weights fit the last-level cache the two differ: on the demo
target (29 MB of weights, a 32 MiB L3) the isolated one-token pass took 1.15x the one-token
pass inside `generate()`'s decoding loop and the isolated 9-token passes 0.91-0.93x the loop's
(so tau(n) / tau(1) came out about a fifth too flat), where the stream reading took 0.89-0.95x
the loop's pass at every n, the loop's time holding the acceptance too; on OLMoE shapes,
whose weights stream from memory, both lie within 0.93-1.11x (`benchmarks/verify_modes.py`).
What a pass costs on such a model depends on what ran before it: a one-token pass right after
a 9-token one pays to bring back the cache lines the larger pass's activations and logits
pushed out, and one pass repeated in place keeps its own experts hot.
"""

import random
import statistics
import time
from collections.abc import Sequence

import torch

from moespec.calibrate.timing import median_iqr
from moespec.decoding.drafters import ModelDrafter
from moespec.decoding.sampling import Sampler
from moespec.models import Transformer
from moespec.progress import Progress

VERIFY_MODES = ("stream", "isolated")
STREAM_PASSES = 6  # timed passes per "stream" value (after one untimed)


def pass_span(depth: int, n: int, mode: str = "stream", passes: int = STREAM_PASSES):
    """[first, end): the text positions one `mode` measurement of n tokens at `depth` runs
    over (the cache must hold the text up to `first`, and room up to `end`)."""
    if mode not in VERIFY_MODES:
        raise ValueError(f"verify mode {mode!r}: expected one of {', '.join(VERIFY_MODES)}")
    if mode == "isolated":
        return depth, depth + n
    if passes < 1:
        raise ValueError(f"a stream verify measurement needs >= 1 timed pass, got {passes}")
    total = (passes + 1) * n
    first = depth - total // 2
    return first, first + total


def time_pass(
    model: Transformer,
    cache,
    tokens: Sequence[int],
    depth: int,
    n: int,
    kernel: str,
    *,
    mode: str = "stream",
    passes: int = STREAM_PASSES,
) -> float:
    """Seconds of one verify pass of n tokens of `tokens` at `depth` with `kernel`, as `mode`
    times it (the module's docstring); `cache` holds at least tokens[:depth] and is left
    holding exactly that. "stream": passes + 1 consecutive passes of n tokens from
    `pass_span`'s first position (so they centre on `depth`), the first untimed, the median
    of the others; "isolated": one pass of tokens[depth : depth + n], rolled back."""
    first, end = pass_span(depth, n, mode, passes)
    if first < 0 or end > len(tokens):
        raise ValueError(
            f"a {mode} verify pass of {n} tokens at depth {depth} runs over text positions "
            f"{first}..{end}, outside the {len(tokens)} tokens given"
        )
    cache.rollback(first)
    times = []
    for at in range(first, end, n):
        batch = torch.tensor(tokens[at : at + n])
        start = time.perf_counter()
        model(batch, cache, kernel=kernel, all_logits=True)
        times.append(time.perf_counter() - start)
    if cache.length > depth:
        cache.rollback(depth)
    return times[0] if mode == "isolated" else statistics.median(times[1:])


def measure_verify(
    model: Transformer,
    tokens: Sequence[int],
    *,
    depth: int = 256,
    pass_sizes: Sequence[int] = tuple(range(1, 10)),
    kernels: Sequence[str] = ("slot", "dedup"),
    repeats: int = 10,
    warmup: int = 2,
    progress: Progress | None = None,
    seed: int = 0,
    mode: str = "stream",
    passes: int = STREAM_PASSES,
    budget_seconds: float | None = None,
    min_repeats: int = 1,
) -> list[dict]:
    """[{kernel, n_tokens, seconds: [...], median, iqr, depth, mode}] of whole-model verify
    passes, each value timed by `time_pass` (mode, passes). progress: reports each round
    (moespec.progress); seed: the rounds' orders.

    budget_seconds: stop adding rounds once the measurement (warm-up included) has run this
    long and at least `min_repeats` rounds are timed (None: all `repeats`). Every round times
    every cell, so a cut run is a smaller sample of the same design: what a full-size model
    needs to plan in minutes (a round of its 18 cells takes ~35 s on 2 cores), where a small
    model still runs every round. `len(record["seconds"])` is the rounds taken."""
    from moespec.errors import SettingError, setting
    from moespec.models.context import fit_context

    spans = [pass_span(depth, n, mode, passes) for n in pass_sizes]
    need = max(end for _, end in spans)
    what, fix = f"a pass after {depth} tokens", f"lower {setting('depth')}"
    fit_context(range(need), model.config, what=what, fix=fix)
    if not 1 <= min_repeats <= repeats:
        raise ValueError(f"min_repeats must lie in 1..{repeats} (repeats), got {min_repeats}")
    if budget_seconds is not None and budget_seconds <= 0:
        raise ValueError(f"a verify time budget must be positive, got {budget_seconds} s")
    if min(first for first, _ in spans) < 0:
        raise SettingError(
            f"measure-verify: a {mode} measurement of {max(pass_sizes)} tokens starts "
            f"before the text at depth {depth}; raise {setting('depth')}"
        )
    if len(tokens) < need:
        raise ValueError(
            f"measure-verify needs {need} tokens of text (depth {depth} and the largest "
            f"pass's {mode} measurement), got {len(tokens)}"
        )
    cache = model.new_cache(capacity=need + 1)
    model(torch.tensor(tokens[:depth]), cache, kernel="dedup")
    samples: dict[tuple[str, int], list[float]] = {}
    progress = progress or Progress(False)
    progress.start("measuring whole-model verify times", total=warmup + repeats, unit="rounds")
    rounds = random.Random(seed)
    started = time.perf_counter()
    for repeat in range(warmup + repeats):
        for n, kernel in round_order(pass_sizes, kernels, rounds):
            elapsed = time_pass(model, cache, tokens, depth, n, kernel, mode=mode, passes=passes)
            if repeat >= warmup:
                samples.setdefault((kernel, n), []).append(elapsed)
        progress.advance()
        timed = repeat + 1 - warmup
        spent = time.perf_counter() - started
        if budget_seconds is not None and timed >= min_repeats and spent >= budget_seconds:
            break
    records = []
    for (kernel, n), values in sorted(samples.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        median, iqr = median_iqr(values)
        records.append(
            {
                "kernel": kernel,
                "n_tokens": n,
                "seconds": values,
                "median": median,
                "iqr": iqr,
                "depth": depth,
                "mode": mode,
            }
        )
    return records


def round_order(pass_sizes, kernels, rng: random.Random) -> list[tuple[int, str]]:
    """One round of timed passes: every (pass size, kernel) once, in `rng`'s random order."""
    cells = [(n, kernel) for n in pass_sizes for kernel in kernels]
    return rng.sample(cells, len(cells))


def verify_run(
    model_dir,
    *,
    text=None,
    dtype: str = "bf16",
    weights: str | None = None,
    kernels: Sequence[str] = ("slot", "dedup"),
    max_n: int = 9,
    depth: int = 256,
    repeats: int = 10,
    mode: str = "stream",
    batch_invariant: bool = True,
    verify_text_kind: str = "continuations",
    progress: Progress | None = None,
) -> dict:
    """What `moespec measure-verify` records: the checkpoint at `model_dir` loaded as `dtype`
    (and `weights`), its verify passes of n = 1..max_n tokens per kernel on the tokens of
    `text` (a file; default: `verify_text_kind` as `plan` reads it, `texts.verify_tokens`:
    the target's greedy continuation of a fit document's start, or the test documents) as
    `mode` times a pass (`time_pass`), batch-invariant as decoding verifies by default (or
    not), with the model, weight paths, depth, every record and the provenance."""
    from pathlib import Path

    from moespec.calibrate.texts import check_verify_text, verify_tokens
    from moespec.demo import describe
    from moespec.kernels.cpu import weight_paths
    from moespec.models import load_model
    from moespec.provenance import provenance

    check_verify_text(verify_text_kind)  # before the model loads
    progress = progress or Progress(False)
    model, tokenizer = load_model(model_dir, dtype=dtype, weights=weights)
    model.batch_invariant = batch_invariant
    if text:
        tokens = tokenizer.encode(Path(text).read_text())
    else:
        first, end = pass_span(depth, max_n, "stream", STREAM_PASSES)
        tokens = verify_tokens(model, tokenizer, verify_text_kind, first, end, progress)
    records = measure_verify(
        model,
        tokens,
        depth=depth,
        pass_sizes=tuple(range(1, max_n + 1)),
        kernels=kernels,
        repeats=repeats,
        progress=progress,
        mode=mode,
    )
    return {
        "model": describe(model_dir),
        "dtype": dtype,
        "weights": weight_paths(model.expert_format, model.dense_format, model.dtype),
        "text": str(text) if text else verify_text_kind,
        "depth": depth,
        "records": records,
        "provenance": provenance(
            model.embed.device,
            {
                "kernels": list(kernels),
                "repeats": repeats,
                "verify_mode": mode,
                "batch_invariant": batch_invariant,
            },
        ),
    }


def measure_draft_time(
    draft: Transformer,
    tokens: Sequence[int],
    *,
    depth: int = 256,
    max_draft_length: int = 8,
    repeats: int = 5,
) -> list[float]:
    """h(k), k = 0..k_max: median seconds for the draft model to propose k tokens after a
    context of `depth` tokens it has already seen (h(0) = 0)."""
    drafter = ModelDrafter(draft, Sampler(), draft.config.vocab_size)
    context = list(tokens[:depth])
    drafter.propose(context, 1)  # prefill the draft's cache with the context
    times = [0.0]
    for k in range(1, max_draft_length + 1):
        values = []
        for _ in range(repeats + 1):
            drafter.propose(context, 1)  # roll the cache back to the context
            start = time.perf_counter()
            drafter.propose(context, k)
            values.append(time.perf_counter() - start)
        times.append(median_iqr(values[1:])[0])
    return times


def verify_table(records: list[dict], kernel: str, max_n: int) -> list[float]:
    """The measured median verify time of `kernel` at n = 1..max_n."""
    by_n = {r["n_tokens"]: r["median"] for r in records if r["kernel"] == kernel}
    missing = [n for n in range(1, max_n + 1) if n not in by_n]
    if missing:
        raise ValueError(f"no measured {kernel} verify time at n = {missing}")
    return [by_n[n] for n in range(1, max_n + 1)]
