"""The decode loop: a generator yielding one typed record per step.

Plain decoding runs one target pass per token; the speculative loop (drafts verified in one
pass of k + 1 tokens) yields the same record type, so the CLI, benchmarks and tests consume
one stream.
"""

import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

import torch

from moespec.decoding.kernel_policy import KernelPolicy
from moespec.decoding.sampling import Sampler
from moespec.models import RoutingSink, Transformer

PREFILL_CHUNK = 512


@dataclass
class StepRecord:
    """One step of generation.

    tokens: the tokens this step emitted (stop token excluded); n_tokens: the target pass size
    (the prompt length for the prefill step); kernel: the expert kernel of that pass;
    seconds: wall time of the step. Speculative steps also fill the draft fields.
    """

    phase: str  # "prefill" or "decode"
    tokens: list[int]
    n_tokens: int
    kernel: str
    seconds: float
    drafted: int = 0
    accepted: int = 0
    draft_length: int = 0
    acceptance_estimate: float | None = None
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    finish_reason: str | None = None  # "stop", "length" on the last step

    def to_dict(self) -> dict:
        return asdict(self)


def prefill(
    model: Transformer,
    prompt: Sequence[int],
    cache,
    kernel: str,
    routing_sink: RoutingSink | None = None,
) -> torch.Tensor:
    """Run the prompt through the model in chunks; return the last position's logits [V]."""
    if not prompt:
        raise ValueError("the prompt must have at least one token")
    ids = torch.tensor(prompt, dtype=torch.long)
    logits = None
    for start in range(0, len(prompt), PREFILL_CHUNK):
        chunk = ids[start : start + PREFILL_CHUNK]
        logits = model(chunk, cache, kernel=kernel, routing_sink=routing_sink)
    return logits[0, -1]


def generate(
    model: Transformer,
    prompt: Sequence[int],
    *,
    max_tokens: int,
    sampler: Sampler | None = None,
    kernels: KernelPolicy | None = None,
    stop_tokens: Sequence[int] = (),
    routing_sink: RoutingSink | None = None,
) -> Iterator[StepRecord]:
    """Plain decoding: yields a prefill record (with the first token), then one per token."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    sampler = sampler or Sampler()
    kernels = kernels or KernelPolicy()
    stops = set(stop_tokens)
    cache = model.new_cache(capacity=len(prompt) + max_tokens + 1)

    start = time.perf_counter()
    kernel = kernels.for_prefill()
    token = sampler.sample(prefill(model, prompt, cache, kernel, routing_sink))
    emitted = 0
    phase, n_tokens = "prefill", len(prompt)
    while True:
        finish = "stop" if token in stops else "length" if emitted + 1 >= max_tokens else None
        yield StepRecord(
            phase=phase,
            tokens=[] if token in stops else [token],
            n_tokens=n_tokens,
            kernel=kernel,
            seconds=time.perf_counter() - start,
            finish_reason=finish,
        )
        if finish:
            return
        emitted += 1
        start = time.perf_counter()
        phase, n_tokens, kernel = "decode", 1, kernels.for_pass(1)
        logits = model(torch.tensor([token]), cache, kernel=kernel, routing_sink=routing_sink)
        token = sampler.sample(logits[0, -1])


def summarize(records: Sequence[StepRecord]) -> dict:
    """Totals of a generation: tokens, steps, and decode throughput (prefill excluded)."""
    decode = [r for r in records if r.phase == "decode"]
    decode_tokens = sum(len(r.tokens) for r in decode)
    decode_seconds = sum(r.seconds for r in decode)
    prefill_records = [r for r in records if r.phase == "prefill"]
    return {
        "generated_tokens": sum(len(r.tokens) for r in records),
        "decode_steps": len(decode),
        "prefill_seconds": sum(r.seconds for r in prefill_records),
        "decode_seconds": decode_seconds,
        "tokens_per_second": decode_tokens / decode_seconds if decode_seconds > 0 else None,
        "finish_reason": records[-1].finish_reason if records else None,
    }
