"""Whole-model measurements the predictions never see: verify time per kernel and pass size,
and the draft model's time per step h(k).

A verification pass of n tokens runs on top of a context of `depth` tokens (teacher forced:
the pass's tokens are the text's next tokens), is timed, and rolled back; kernels and pass
sizes are interleaved within each repeat so slow drift of the machine spreads evenly, in a
fresh random order each repeat (`round_order`): in a fixed order the first pass of every round
ran 12-22% slower than the same pass later in the round (on the demo target, whose one-token
pass takes 0.3 ms), which made the per-slot kernel at n = 1 look slower than the identical
deduplicating one.
"""

import random
import time
from collections.abc import Sequence

import torch

from moespec.calibrate.timing import median_iqr
from moespec.decoding.drafters import ModelDrafter
from moespec.decoding.sampling import Sampler
from moespec.models import Transformer
from moespec.progress import Progress


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
) -> list[dict]:
    """[{kernel, n_tokens, seconds: [...], median, iqr}] of whole-model verify passes.
    progress: reports each round (moespec.progress); seed: the rounds' orders."""
    from moespec.errors import setting
    from moespec.models.context import fit_context

    need = depth + max(pass_sizes)
    what, fix = f"a pass after {depth} tokens", f"lower {setting('depth')}"
    fit_context(range(need), model.config, what=what, fix=fix)
    if len(tokens) < need:
        raise ValueError(
            f"measure-verify needs {need} tokens of text (depth {depth} + the "
            f"largest pass), got {len(tokens)}"
        )
    cache = model.new_cache(capacity=need + 1)
    model(torch.tensor(tokens[:depth]), cache, kernel="dedup")
    samples: dict[tuple[str, int], list[float]] = {}
    progress = progress or Progress(False)
    progress.start("measuring whole-model verify times", total=warmup + repeats, unit="rounds")
    rounds = random.Random(seed)
    for repeat in range(warmup + repeats):
        for n, kernel in round_order(pass_sizes, kernels, rounds):
            batch = torch.tensor(tokens[depth : depth + n])
            start = time.perf_counter()
            model(batch, cache, kernel=kernel, all_logits=True)
            elapsed = time.perf_counter() - start
            cache.rollback(depth)
            if repeat >= warmup:
                samples.setdefault((kernel, n), []).append(elapsed)
        progress.advance()
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
    progress: Progress | None = None,
) -> dict:
    """What `moespec measure-verify` records: the checkpoint at `model_dir` loaded as `dtype`
    (and `weights`), its verify passes of n = 1..max_n tokens per kernel on the tokens of
    `text` (a file; default: the test documents the plan measures on, `calibrate.texts`), with
    the model, weight paths, depth, every record and the provenance."""
    from pathlib import Path

    from moespec.calibrate.texts import verify_text
    from moespec.demo import describe
    from moespec.kernels.cpu import weight_paths
    from moespec.models import load_model
    from moespec.provenance import provenance

    model, tokenizer = load_model(model_dir, dtype=dtype, weights=weights)
    tokens = tokenizer.encode(Path(text).read_text()) if text else verify_text(tokenizer)
    records = measure_verify(
        model,
        tokens,
        depth=depth,
        pass_sizes=tuple(range(1, max_n + 1)),
        kernels=kernels,
        repeats=repeats,
        progress=progress,
    )
    return {
        "model": describe(model_dir),
        "dtype": dtype,
        "weights": weight_paths(model.expert_format, model.dense_format, model.dtype),
        "text": str(text) if text else "the test documents of moespec.calibrate.texts",
        "depth": depth,
        "records": records,
        "provenance": provenance(
            model.embed.device, {"kernels": list(kernels), "repeats": repeats}
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
