"""The decode loop: a generator yielding one typed record per step.

Plain decoding runs one target pass per token; the speculative loop (drafts verified in one
pass of k + 1 tokens) yields the same record type, so the CLI, benchmarks and tests consume
one stream.
"""

import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace

import torch

from moespec.decoding.adjust import LogitAdjust, TokenLogprob, token_logprobs
from moespec.decoding.draft_policy import DraftLengthPolicy
from moespec.decoding.drafters import Drafter
from moespec.decoding.kernel_policy import KernelPolicy
from moespec.decoding.sampling import Sampler
from moespec.decoding.speculation import Speculation
from moespec.decoding.verify import verify
from moespec.models import RoutingSink, Transformer

PREFILL_CHUNK = 512
OFFLOAD_FIELDS = ("hits", "misses", "bytes_copied", "cpu_experts")


@dataclass
class StepRecord:
    """One step of generation.

    tokens: the tokens this step emitted (stop token excluded); n_tokens: the target pass size
    (the prompt length for the prefill step); kernel: the expert kernel of that pass;
    seconds: wall time of the step. Speculative steps also fill the draft fields; drafter
    names who drafted ("model", "lookup", "oracle"), None for a step without a draft.
    """

    phase: str  # "prefill" or "decode"
    tokens: list[int]
    n_tokens: int
    kernel: str
    seconds: float
    drafter: str | None = None
    drafted: int = 0
    accepted: int = 0
    draft_length: int = 0
    acceptance_estimate: float | None = None
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    finish_reason: str | None = None  # "stop", "length" on the last step
    # a step bought to measure rather than because it pays ("warm-up", "probe", "neighbour":
    # moespec.decoding.draft_policy.Plan.probe), None for a step that pays on the evidence
    explore: str | None = None
    # Offloaded experts (moespec.offload): needed experts found cached and arrived, not so,
    # bytes copied into the expert cache, experts computed on the CPU.
    hits: int = 0
    misses: int = 0
    bytes_copied: int = 0
    cpu_experts: int = 0
    # with generate(logprobs=N): each emitted token's log-probability and N alternatives
    logprobs: list[TokenLogprob] | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def prefill(
    model: Transformer,
    prompt: Sequence[int],
    cache,
    kernel: str,
    routing_sink: RoutingSink | None = None,
    offload=None,
) -> torch.Tensor:
    """Run the prompt through the model in chunks; return the last position's logits [V]."""
    if not prompt:
        raise ValueError("the prompt must have at least one token")
    ids = torch.tensor(prompt, dtype=torch.long)
    logits = None
    for start in range(0, len(prompt), PREFILL_CHUNK):
        chunk = ids[start : start + PREFILL_CHUNK]
        if offload is not None:
            offload.begin_step(len(chunk), prefill=True)
        logits = model(chunk, cache, kernel=kernel, routing_sink=routing_sink, offload=offload)
        if offload is not None:
            offload.end_step(0)
    return logits[0, -1]


def generate(
    model: Transformer,
    prompt: Sequence[int],
    *,
    max_tokens: int,
    sampler: Sampler | None = None,
    kernels: KernelPolicy | None = None,
    drafter: Drafter | Speculation | None = None,
    draft_policy: DraftLengthPolicy | None = None,
    stop_tokens: Sequence[int] = (),
    routing_sink: RoutingSink | None = None,
    offload=None,
    adjust: LogitAdjust | None = None,
    logprobs: int | None = None,
) -> Iterator[StepRecord]:
    """Decode, yielding a prefill record (with the first token), then one record per step.

    Without a drafter every step is one pass of one token (plain decoding). With one, a step
    drafts k = draft_policy.choose() tokens, verifies them with the current token in one target
    pass of k + 1 tokens, emits the accepted drafts plus one target token, and rolls the
    target's cache back past the rejected drafts. drafter may also be a `Speculation`, which
    chooses per step among several drafters (and none); a step that drafts nothing is a plain
    step, the drafters not run.

    offload: an offload engine (moespec.offload.engine.executor) running the target's experts from
    its tiers; each pass is bracketed by its begin_step/end_step, and records carry its stats.
    adjust: logit bias and penalties applied to every row the target samples or verifies from
    (moespec.decoding.adjust); logprobs: with it, each record carries the log-probability of
    each emitted token and this many alternatives (`StepRecord.logprobs`).
    """
    decoding = Decoding(
        model,
        prompt,
        max_tokens=max_tokens,
        sampler=sampler,
        kernels=kernels,
        drafter=drafter,
        draft_policy=draft_policy,
        stop_tokens=stop_tokens,
        routing_sink=routing_sink,
        offload=offload,
        adjust=adjust,
        logprobs=logprobs,
    )
    yield decoding.start()
    while not decoding.done:
        feed = decoding.plan()
        kernel = decoding.kernels.for_pass(len(feed))
        logits = model(
            torch.tensor(feed),
            decoding.cache,
            kernel=kernel,
            all_logits=len(feed) > 1,
            routing_sink=routing_sink,
            offload=offload,
        )[0]
        yield decoding.finish(logits, kernel)


class Decoding:
    """One sequence's decoding, a step at a time, for loops that run the target's passes
    themselves (`generate` one sequence, a batch several in one pass).

    `start()` prefills and returns the prefill record; then, until `done`, `plan()` drafts and
    returns the tokens of the step's target pass (the current token, then the drafts), the
    caller runs them through the target at the end of `cache`, and `finish(logits, kernel)`
    verifies, rolls the cache back past rejected drafts and returns the step's record.
    Settings as `generate`'s.
    """

    def __init__(
        self,
        model: Transformer,
        prompt: Sequence[int],
        *,
        max_tokens: int,
        sampler: Sampler | None = None,
        kernels: KernelPolicy | None = None,
        drafter: Drafter | Speculation | None = None,
        draft_policy: DraftLengthPolicy | None = None,
        stop_tokens: Sequence[int] = (),
        routing_sink: RoutingSink | None = None,
        offload=None,
        adjust: LogitAdjust | None = None,
        logprobs: int | None = None,
    ):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.model, self.prompt, self.max_tokens = model, prompt, max_tokens
        self.sampler = sampler or Sampler()
        self.kernels = kernels or KernelPolicy()
        self.speculation = drafter
        if drafter is not None and not isinstance(drafter, Speculation):
            self.speculation = Speculation.single(drafter, draft_policy)
        self.stops = set(stop_tokens)
        self.routing_sink, self.offload = routing_sink, offload
        self.adjust, self.logprobs = adjust, logprobs
        self.cache = model.new_cache(capacity=len(prompt) + max_tokens + 1)
        self.context: list[int] = []  # the prompt and what was emitted; the cache lacks the last
        self.emitted = 0
        self.done = False
        self._step = None  # (proposal, draft, step start, verify start) between plan and finish

    def start(self) -> StepRecord:
        """Prefill the prompt and sample the first token: the prefill record. With a drafter,
        the model's batch-invariance probes are taken first, untimed: a one-time setup of the
        process (`Transformer.warm_invariance`), like building the native library."""
        if self.speculation is not None:
            self.model.warm_invariance(offloaded=self.offload is not None)
        start = time.perf_counter()
        kernel = self.kernels.for_prefill()
        prompt, offload = self.prompt, self.offload
        logits = prefill(self.model, prompt, self.cache, kernel, self.routing_sink, offload)
        if self.adjust is not None:
            logits = self.adjust.apply(logits)
        first = self.sampler.sample(logits, position=len(prompt))
        self.context = list(prompt) + [first]
        record = StepRecord("prefill", [first], len(prompt), kernel, 0.0)
        if offload is not None:
            record = replace(record, **offload.take_stats())
        if self.logprobs is not None:
            record.logprobs = token_logprobs(logits, [first], self.logprobs)
        if self.adjust is not None:
            self.adjust.emitted([first])
        self.emitted = 1
        return self._close(record, start)

    def plan(self) -> list[int]:
        """Draft this step's tokens; the target pass's tokens: the current one, then them."""
        start = time.perf_counter()
        proposal = draft = None
        if self.speculation is not None:
            proposal = self.speculation.propose(self.context, self.max_tokens - self.emitted - 1)
            draft = proposal.draft.tokens
        drafted = len(draft) if draft else 0
        verify_start = time.perf_counter()
        if self.offload is not None:
            drafting = verify_start - start
            self.offload.begin_step(drafted + 1, drafted=drafted, draft_seconds=drafting)
        self._step = (proposal, draft or [], start, verify_start)
        return self.context[-1:] + (draft or [])

    def finish(self, logits: torch.Tensor, kernel: str, shared: bool = False) -> StepRecord:
        """Verify the step's pass: logits [k + 1, V] of its tokens (k the drafts); the record.
        shared: the pass also ran other sequences' tokens, so its time is not this step's
        tau(k + 1): the caller observes the kernel's time, and no verify time is recorded."""
        proposal, draft, start, verify_start = self._step
        drafted = len(draft)
        if self.adjust is not None:
            logits = self.adjust.apply(logits, draft)
        position = len(self.context)  # of the first token this step emits
        if drafted:
            accepted, tokens = verify(draft, logits, self.sampler, proposal.draft.probs, position)
        else:
            accepted, tokens = 0, [self.sampler.sample(logits[-1], position=position)]
        if self.offload is not None:
            self.offload.end_step(accepted)
        if accepted < drafted:
            self.cache.rollback(len(self.context) + accepted)
        verify_seconds = time.perf_counter() - verify_start
        if not shared:
            self.kernels.observe(drafted + 1, kernel, verify_seconds)
        if proposal is not None:
            self.speculation.observe(proposal, accepted, tokens, None if shared else verify_seconds)
        tokens = tokens[: self.max_tokens - self.emitted]
        if self.adjust is not None:
            self.adjust.emitted(tokens)
        self.context.extend(tokens)
        self.emitted += len(tokens)
        speculation = self.speculation
        record = StepRecord(
            phase="decode",
            tokens=tokens,
            n_tokens=drafted + 1,
            kernel=kernel,
            seconds=0.0,
            drafter=proposal.drafter if proposal is not None and drafted else None,
            drafted=drafted,
            accepted=accepted,
            draft_length=proposal.draft_length if proposal is not None else 0,
            acceptance_estimate=(
                speculation.estimate_for(proposal.drafter) if proposal is not None else None
            ),
            draft_seconds=verify_start - start,
            verify_seconds=verify_seconds,
            explore=proposal.probe if proposal is not None and drafted else None,
            **(self.offload.take_stats() if self.offload is not None else {}),
        )
        if self.logprobs is not None:
            record.logprobs = token_logprobs(logits, tokens, self.logprobs)
        return self._close(record, start)

    def _close(self, record: StepRecord, start: float) -> StepRecord:
        """Truncate at a stop token or the token budget; the record closes the step."""
        for i, token in enumerate(record.tokens):
            if token in self.stops:
                record.tokens, record.finish_reason = record.tokens[:i], "stop"
                if record.logprobs is not None:
                    record.logprobs = record.logprobs[:i]
                break
        if record.finish_reason is None and self.emitted >= self.max_tokens:
            record.finish_reason = "length"
        record.seconds = time.perf_counter() - start
        self.done = record.finish_reason is not None
        return record


def summarize(records: Sequence[StepRecord]) -> dict:
    """Totals of a generation: tokens, steps, and decode throughput (prefill excluded)."""
    decode = [r for r in records if r.phase == "decode"]
    decode_tokens = sum(len(r.tokens) for r in decode)
    decode_seconds = sum(r.seconds for r in decode)
    prefill_records = [r for r in records if r.phase == "prefill"]
    drafted = sum(r.drafted for r in decode)
    return {
        "generated_tokens": sum(len(r.tokens) for r in records),
        "decode_steps": len(decode),
        "drafted": drafted,
        "accepted": sum(r.accepted for r in decode),
        "mean_accepted_per_step": (
            sum(r.accepted for r in decode) / len(decode) if decode else None
        ),
        "mean_tokens_per_step": decode_tokens / len(decode) if decode else None,
        "exploring_steps": sum(r.explore is not None for r in decode),
        "prefill_seconds": sum(r.seconds for r in prefill_records),
        "decode_seconds": decode_seconds,
        "tokens_per_second": decode_tokens / decode_seconds if decode_seconds > 0 else None,
        "finish_reason": records[-1].finish_reason if records else None,
        **{name: sum(getattr(r, name) for r in records) for name in OFFLOAD_FIELDS},
    }
