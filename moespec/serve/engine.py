"""The engine behind the server: a bounded queue and one worker decoding at batch size 1.

Each request becomes a `Job`; the worker runs it through the same generator loop as
`moespec generate` (moespec.decoding.generate), one StepRecord at a time, and between steps
checks the job's cancel flag (set when the client disconnects). Text goes back to the request's
event loop as it is decoded, cut at stop strings. A full queue refuses at once (`QueueFull`).
"""

import asyncio
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from moespec.decoding import KernelPolicy, Sampler, generate, summarize
from moespec.decoding.adjust import LogitAdjust
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


@dataclass
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
    next job (queued jobs wait), `resume()` lets it go on."""

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
    ):
        self.check_limits(max_queue, max_tokens_limit, max_request_bytes, max_prompt_tokens)
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
        self.running: Job | None = None
        self.recent_seconds = deque(maxlen=8)  # wall time of recent jobs, for Retry-After
        self.worker = threading.Thread(target=self._work, name="moespec-serve-worker", daemon=True)
        self.worker.start()

    @staticmethod
    def check_limits(
        max_queue: int,
        max_tokens_limit: int,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        max_prompt_tokens: int | None = None,
    ) -> None:
        at_least = {
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
        idle = self.running is None and not self.paused and not self.pending
        if not idle and len(self.pending) >= self.max_queue:
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
            if self.running is not None:
                self.running.cancel()
            self.condition.notify_all()
        self.worker.join(timeout=60)
        self.speculation.write_back()

    def render_metrics(self) -> str:
        with self.condition:
            waiting, running = len(self.pending), int(self.running is not None)
        return self.metrics.render(waiting, self.max_queue, running)

    # -- the worker --------------------------------------------------------------------------
    def _next(self) -> Job | None:
        with self.condition:
            while not self.closed and (self.paused or not self.pending):
                self.condition.wait()
            if self.closed:
                return None
            self.running = self.pending.popleft()
            return self.running

    def _work(self) -> None:
        while (job := self._next()) is not None:
            start = time.perf_counter()
            try:
                if not job.cancelled.is_set():
                    self._decode(job)
                else:
                    self.metrics.count_generation("cancelled", len(job.prompt), [])
            except Exception as error:  # a failed generation must not stop the server
                self.metrics.count_generation("error", len(job.prompt), [])
                job.send("error", f"generation failed: {type(error).__name__}: {error}")
            finally:
                with self.condition:
                    self.running = None
                    self.recent_seconds.append(time.perf_counter() - start)
                job.finished.set()

    def _decode(self, job: Job) -> None:
        """Run the generator loop for one job, sending text as it comes."""
        spec = self.speculation
        records, text = [], StopText(self.tokenizer, job.stops)
        steps = generate(
            self.model,
            job.prompt,
            max_tokens=job.max_tokens,
            sampler=job.sampler,
            kernels=self.kernels,
            drafter=spec.drafter(job.sampler, job.prompt, job.max_tokens, job.seed),
            stop_tokens=self.model.config.eos_token_ids,
            adjust=job.adjust,
            logprobs=job.logprobs,
        )
        finish = None
        try:
            for record in steps:
                records.append(record)
                self.metrics.observe(record)
                piece, stopped = text.add(record.tokens)
                if stopped:
                    finish = "stop"
                elif record.finish_reason is not None:
                    finish = record.finish_reason
                    piece += text.finish()
                if piece or record.logprobs:
                    job.send("text", (piece, record.logprobs))
                if finish is None and job.cancelled.is_set():
                    finish = "cancelled"
                if finish is not None:
                    break
        finally:
            steps.close()
        self.metrics.count_generation(finish, len(job.prompt), records)
        job.send("done", done_event(records, finish, spec.name))


def done_event(records, finish_reason: str, draft: str) -> dict:
    """What a finished job reports: its finish reason, token count and speculation stats."""
    stats = summarize(records)
    keep = ("drafted", "accepted", "decode_steps", "tokens_per_second")
    return {
        "finish_reason": finish_reason,
        "completion_tokens": stats["generated_tokens"],
        "stats": {key: stats[key] for key in keep} | {"draft": draft},
    }
