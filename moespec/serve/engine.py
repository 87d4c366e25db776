"""The engine behind the server: a bounded queue and one worker decoding at batch size 1.

Each request becomes a `Job`; the worker runs it through the same generator loop as
`moespec generate` (moespec.decoding.generate), one StepRecord at a time, and between steps
checks the job's cancel flag (set when the client disconnects). Text goes back to the request's
event loop as it is decoded, cut at stop strings. A full queue refuses at once (`QueueFull`).

With offloaded experts (an offload engine, opened once for the server's life and closed with
it) the worker decodes one job at a time through `generate` with that engine, as `moespec
generate` does: the batched pass does not run offloaded experts.
"""

import asyncio
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from moespec.decoding import KernelPolicy, Sampler, generate, summarize
from moespec.decoding.adjust import LogitAdjust
from moespec.decoding.batch import BatchRequest, decode_batch
from moespec.errors import SettingError, setting
from moespec.models import Tokenizer, Transformer
from moespec.serve.metrics import Metrics
from moespec.serve.speculation import Speculation
from moespec.serve.text import ChatTemplate, StopText

MAX_REQUEST_BYTES = 4 * 2**20  # a body's bytes: 4 MiB holds a 100k-token prompt as ids


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"the queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


@dataclass(eq=False)  # a job is itself: a key of the running batch
class Job:
    """One request at batch size 1. Events to its loop: ("text", (str, [TokenLogprob] or
    None)), then ("done", dict) or ("error", str)."""

    prompt: list[int]
    max_tokens: int
    sampler: Sampler
    seed: int
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    adjust: LogitAdjust | None = None  # logit bias and penalties (fresh per request)
    logprobs: int | None = None  # alternatives per token's logprob; None: no logprobs
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()

    def send(self, kind: str, value) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the request's loop is gone: nobody is listening
            self.cancel()


class Engine:
    """model + tokenizer + speculation + kernel policy; `submit(job)` queues a job or raises
    QueueFull; one worker thread decodes jobs in order. `pause()` holds the worker before its
    next job (queued jobs wait), `resume()` lets it go on. offload: an offload engine
    (moespec.offload.engine) running the target's experts, for every job in turn (max_batch
    1); `close()` closes it."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        speculation: Speculation,
        *,
        model_name: str,
        kernels: KernelPolicy | None = None,
        chat_template: ChatTemplate | None = None,
        max_queue: int = 16,
        max_tokens_limit: int = 1024,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        max_prompt_tokens: int | None = None,
        max_batch: int = 1,
        offload=None,
    ):
        self.check_limits(
            max_queue, max_tokens_limit, max_request_bytes, max_prompt_tokens, max_batch
        )
        if offload is not None and max_batch > 1:
            raise SettingError(offload_alone(max_batch))
        self.max_batch = max_batch
        self.offload = None if offload is None else Bracketed(offload)
        self.model, self.tokenizer, self.speculation = model, tokenizer, speculation
        self.model_name = model_name
        self.kernels = kernels or KernelPolicy()
        self.chat_template = chat_template or ChatTemplate(None)
        self.max_queue, self.max_tokens_limit = max_queue, max_tokens_limit
        self.context_length = model.config.max_position_embeddings
        self.vocab_size = model.config.vocab_size  # the ids the model embeds
        self.max_request_bytes = max_request_bytes
        self.max_prompt_tokens = min(max_prompt_tokens or self.context_length, self.context_length)
        # No text longer than this encodes to max_prompt_tokens tokens or fewer: none of its
        # tokens is longer than the vocabulary's longest (twice it: a normaliser may compose)
        self.prompt_characters = 2 * self.max_prompt_tokens * tokenizer.longest_token
        self.metrics = Metrics()
        self.pending: deque[Job] = deque()
        self.condition = threading.Condition()
        self.paused = self.closed = False
        self.active: dict[Job, Running] = {}  # the running batch's jobs
        self.recent_seconds = deque(maxlen=8)  # wall time of recent jobs, for Retry-After
        self.worker = threading.Thread(target=self._work, name="moespec-serve-worker", daemon=True)
        self.worker.start()

    @staticmethod
    def check_limits(
        max_queue: int,
        max_tokens_limit: int,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        max_prompt_tokens: int | None = None,
        max_batch: int = 1,
    ) -> None:
        at_least = {
            "max_batch": (max_batch, 1),
            "max_queue": (max_queue, 0),
            "max_tokens_limit": (max_tokens_limit, 1),
            "max_request_bytes": (max_request_bytes, 1024),
            "max_prompt_tokens": (max_prompt_tokens or 1, 1),
        }
        for name, (value, low) in at_least.items():
            if value < low:
                raise SettingError(f"{setting(name)} must be >= {low}, got {value}")

    # -- the queue ---------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self.condition:
            if self.closed:
                raise RuntimeError("the engine is closed")
            self._check_room()
            self.pending.append(job)
            self.condition.notify_all()

    def check_room(self) -> None:
        """Raise QueueFull if a job submitted now would be refused."""
        with self.condition:
            self._check_room()

    def _check_room(self) -> None:
        """Room: a free place in the running batch (none while paused), or in the queue."""
        free = 0 if self.paused else self.max_batch - len(self.active)
        if len(self.pending) >= self.max_queue + max(free, 0):
            raise QueueFull(self.retry_after())

    def retry_after(self) -> int:
        """Seconds until the queue has likely moved: its length times a recent job's time
        (the median of the last few; call with the condition held)."""
        recent = sorted(self.recent_seconds) or [1.0]
        typical = recent[len(recent) // 2]
        return max(1, math.ceil(typical * (len(self.pending) + 1)))

    def queue_length(self) -> int:
        with self.condition:
            return len(self.pending)

    def pause(self) -> None:
        with self.condition:
            self.paused = True

    def resume(self) -> None:
        with self.condition:
            self.paused = False
            self.condition.notify_all()

    def close(self) -> None:
        with self.condition:
            self.closed = True
            for job in self.pending:
                job.cancel()
                job.send("error", "the server is shutting down")
            self.pending.clear()
            for job in self.active:
                job.cancel()
            self.condition.notify_all()
        self.worker.join(timeout=60)
        self.speculation.write_back()
        if self.offload is not None:  # its link and I/O threads, its file
            self.offload.close()

    def render_metrics(self) -> str:
        with self.condition:
            waiting, running = len(self.pending), len(self.active)
        offload = self.offload.summary() if self.offload is not None else None
        return self.metrics.render(waiting, self.max_queue, running, offload)

    # -- the worker --------------------------------------------------------------------------
    def _requests(self):
        """The batch's next requests: a queued job when there is one, None when there is none
        now but jobs run (the batch goes on), blocking while nothing runs or is queued."""
        while True:
            with self.condition:
                while not self.closed and (self.paused or not self.pending) and not self.active:
                    self.condition.wait()
                if self.closed:
                    return
                job = None if self.paused or not self.pending else self.pending.popleft()
                if job is not None and not job.cancelled.is_set():
                    self.active[job] = Running(job, StopText(self.tokenizer, job.stops))
            if job is None:
                yield None
            elif job.cancelled.is_set():  # its client left while it waited
                self.metrics.count_generation("cancelled", len(job.prompt), [])
                job.finished.set()
            else:
                yield self._request(job)

    def _request(self, job: Job) -> BatchRequest:
        spec = self.speculation
        return BatchRequest(
            key=job,
            prompt=job.prompt,
            max_tokens=job.max_tokens,
            sampler=job.sampler,
            drafter=spec.drafter(job.sampler, job.prompt, job.max_tokens, job.seed),
            stop_tokens=tuple(self.model.config.eos_token_ids),
            adjust=job.adjust,
            logprobs=job.logprobs,
            halt=self.active[job].halt,
        )

    def _work(self) -> None:
        """Decode jobs in a continuous batch of up to max_batch until the engine closes; a
        failure fails the jobs then running (never the server) and the batch starts again."""
        while not self.closed:
            try:
                for job, record in self._decode():
                    self._deliver(self.active[job], record)
            except Exception as error:  # a failed generation must not stop the server
                for running in list(self.active.values()):
                    message = f"generation failed: {type(error).__name__}: {error}"
                    self._end(running, "error", message)

    def _decode(self):
        """(job, record) as the jobs decode: a continuous batch of up to max_batch in memory;
        with offloaded experts, one job at a time through `generate` and the offload engine."""
        if self.offload is None:
            return decode_batch(
                self.model, self._requests(), max_batch=self.max_batch, kernels=self.kernels
            )
        return self._decode_offloaded()

    def _decode_offloaded(self):
        for request in self._requests():
            if request is None:  # none now (none runs either: the wait was for a job)
                continue
            records = generate(
                self.model,
                request.prompt,
                max_tokens=request.max_tokens,
                sampler=request.sampler,
                kernels=self.kernels,
                drafter=request.drafter,
                stop_tokens=request.stop_tokens,
                offload=self.offload,
                adjust=request.adjust,
                logprobs=request.logprobs,
            )
            try:
                for record in records:
                    yield request.key, record
                    if request.halt.is_set():  # it ended: done, cancelled or failed
                        break
            finally:
                records.close()
                self.offload.settle()  # a pass that failed midway left its step open

    def _deliver(self, running: "Running", record) -> None:
        """Send a job's new text (cut at stop strings), and end it when it is done."""
        job = running.job
        running.records.append(record)
        self.metrics.observe(record)
        piece, stopped = running.text.add(record.tokens)
        finish = "stop" if stopped else record.finish_reason
        if finish is not None and not stopped:
            piece += running.text.finish()
        if piece or record.logprobs:
            job.send("text", (piece, record.logprobs))
        if finish is None and job.cancelled.is_set():
            finish = "cancelled"
        if finish is not None:
            self._end(running, finish)

    def _end(self, running: "Running", finish: str, error: str | None = None) -> None:
        job = running.job
        running.halt.set()  # the batch drops it before its next step
        self.metrics.count_generation(finish, len(job.prompt), running.records)
        if error is not None:
            job.send("error", error)
        else:
            job.send("done", done_event(running.records, finish, self.speculation.name))
        with self.condition:
            self.active.pop(job, None)
            self.recent_seconds.append(time.perf_counter() - running.started)
            self.condition.notify_all()
        job.finished.set()


def offload_alone(max_batch: int) -> str:
    """Why offloaded experts decode one request at a time (a `setting`-marked message)."""
    return (
        f"{setting('offload')} decodes one request at a time: it does not take "
        f"{setting('max_batch', max_batch)} (the batched pass does not run offloaded experts)"
    )


class Bracketed:
    """An offload engine as the decode loop drives it, knowing whether a pass is open (begun,
    not ended): a generation that fails midway leaves its step open, and `settle()` ends it, so
    the next request's passes may begin. Everything else is the engine's."""

    def __init__(self, engine):
        self.engine, self.open = engine, False

    def begin_step(self, n_tokens: int, **step) -> None:
        self.engine.begin_step(n_tokens, **step)
        self.open = True

    def end_step(self, accepted: int) -> None:
        self.open = False
        self.engine.end_step(accepted)

    def settle(self) -> None:
        if self.open:
            self.end_step(0)

    def __call__(self, layer: int, x, expert_ids, expert_weights, kernel: str):
        return self.engine(layer, x, expert_ids, expert_weights, kernel)

    def take_stats(self) -> dict:
        return self.engine.take_stats()

    def summary(self) -> dict | None:
        """The engine's totals (`OffloadEngine.summary`); None before it has started (the first
        decode step), when its policy's own figures do not exist yet."""
        return self.engine.summary() if self.engine.started else None

    def describe(self) -> str:
        """The policy, where the expert cache fills from or lies, and its budget."""
        engine = self.engine
        name = getattr(engine.policy, "name", type(engine.policy).__name__)
        return f"{name} ({engine.backend.name}, cache {engine.budget_bytes} bytes)"

    def close(self) -> None:
        self.engine.close()


@dataclass
class Running:
    """A job in the running batch: its records, its text cut at stop strings, and the flag
    that takes it out of the batch."""

    job: Job
    text: StopText
    records: list = field(default_factory=list)
    halt: threading.Event = field(default_factory=threading.Event)
    started: float = field(default_factory=time.perf_counter)


def done_event(records, finish_reason: str, draft: str) -> dict:
    """What a finished job reports: its finish reason, token count and speculation stats."""
    stats = summarize(records)
    keep = ("drafted", "accepted", "decode_steps", "tokens_per_second")
    return {
        "finish_reason": finish_reason,
        "completion_tokens": stats["generated_tokens"],
        "stats": {key: stats[key] for key in keep} | {"draft": draft},
    }
