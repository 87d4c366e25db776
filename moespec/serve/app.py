"""The HTTP layer: FastAPI routes over an `Engine`, in the OpenAI API's shapes.

POST /v1/completions, POST /v1/chat/completions (both with "stream": true as server-sent
events, closed by `data: [DONE]`), GET /v1/models, GET /health, GET /metrics (Prometheus text).
A body is read whole, up to the engine's byte limit, before the app sees it (`BodyLimit`: 413
past it); parsing, validation, the chat template and tokenization then run in a worker thread
(`prepare`), never on the event loop. Every refusal is an OpenAI error body: 400 for bad input
(invalid UTF-8 and malformed JSON included), 404 for an unknown model, 413, and 429 with
Retry-After when the queue is full; a client that disconnects cancels its generation.
"""

import asyncio
import json
import secrets
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from moespec import __version__
from moespec.decoding import Sampler
from moespec.serve import protocol
from moespec.serve.engine import Engine, Job, QueueFull
from moespec.serve.protocol import ApiError, ChatRequest, CompletionRequest

DEFAULT_MAX_TOKENS = 256
DRAIN_BYTES = 64 * 2**20  # the most of a refused body read and dropped; past it, the close
CLIENT_CLOSED = 499  # the request's status when its client left before the answer (as nginx)


def create_app(engine: Engine) -> FastAPI:
    app = FastAPI(title="moespec", version=__version__, docs_url=None, redoc_url=None)
    # outermost first: count every answer; refuse an oversized body (413 whatever the load);
    # refuse with 429 while the queue is full, before the body is parsed
    app.add_middleware(Admission, engine=engine)
    app.add_middleware(BodyLimit, limit=engine.max_request_bytes)
    app.add_middleware(CountStatus, metrics=engine.metrics)
    add_error_handlers(app)
    created = int(time.time())

    # async: these answer on the event loop, never waiting for a worker thread
    @app.get("/health")
    async def health():
        return {"status": "ok", "model": engine.model_name, "queue_length": engine.queue_length()}

    @app.get("/v1/models")
    async def models():
        card = {
            "id": engine.model_name,
            "object": "model",
            "created": created,
            "owned_by": "moespec",
        }
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(engine.render_metrics(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request):
        raw = await request.body()
        prepared = await run_in_threadpool(prepare, engine, raw, CompletionRequest)
        return await answer(engine, request, prepared, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        raw = await request.body()
        prepared = await run_in_threadpool(prepare, engine, raw, ChatRequest)
        return await answer(engine, request, prepared, chat=True)

    return app


def too_busy(full: QueueFull) -> ApiError:
    headers = {"Retry-After": str(full.retry_after)}
    return ApiError(429, str(full), code="queue_full", headers=headers)


@dataclass
class Prepared:
    """A request read, checked and tokenized: what the engine needs, and what the answer says."""

    settings: protocol.Settings
    prompt: list[int]
    stops: list[str]


def prepare(engine: Engine, raw: bytes, kind) -> Prepared:
    """Parse, validate and tokenize a body (in a worker thread: a long prompt's JSON, template
    and tokenization never hold the event loop)."""
    body = parse_body(raw, kind)
    if body.model is not None and body.model != engine.model_name:
        message = (
            f"the model {body.model!r} does not exist; this server serves {engine.model_name!r}"
        )
        raise ApiError(404, message, param="model", code="model_not_found")
    settings = body.settings(engine.vocab_size)
    if kind is ChatRequest:
        try:
            text = engine.chat_template.render(body.chat_messages())
        except ValueError as error:
            raise ApiError(400, str(error), param="messages") from None
        prompt = encode(engine, text, "messages")
        stops = settings.stops + engine.chat_template.implicit_stops
    else:
        prompt, stops = completion_prompt(engine, body.prompt), settings.stops
    settings.max_tokens = token_budget(engine, settings.max_tokens, len(prompt))
    return Prepared(settings, prompt, stops)


def parse_body(raw: bytes, kind):
    """The body as `kind`, or a 400 naming what is wrong: not UTF-8, not JSON, nested past
    Python's recursion limit, not an object, or a field of the wrong type or range."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        message = f"the body is not valid UTF-8 (byte {error.start}: {error.reason})"
        raise ApiError(400, message, code="invalid_utf8") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ApiError(400, f"the body is not valid JSON: {error}", code="json_invalid") from None
    except RecursionError:
        message = "the body's JSON is nested too deeply"
        raise ApiError(400, message, code="json_invalid") from None
    if not isinstance(value, dict):
        message = "the body must be a JSON object (Content-Type: application/json)"
        raise ApiError(400, message, code="json_invalid")
    try:
        return kind.model_validate(value)
    except ValidationError as error:
        raise validation_error(error.errors()) from None
    except RecursionError:  # a field nested deeper than the validator follows
        raise ApiError(400, "the body is nested too deeply", code="json_invalid") from None


def encode(engine: Engine, text: str, param: str) -> list[int]:
    """Token ids of a prompt text; a text too long to fit the prompt limit whatever it encodes
    to is refused before the tokenizer sees it (`Engine.prompt_characters`)."""
    if len(text) > engine.prompt_characters:
        raise ApiError(
            400,
            f"the prompt is {len(text)} characters; at most {engine.max_prompt_tokens} tokens "
            f"({engine.prompt_characters} characters) fit",
            param=param,
            code="context_length_exceeded",
        )
    ids = engine.tokenizer.encode(text)
    if not ids:
        raise ApiError(400, "the prompt encodes to no tokens", param=param)
    return check_ids(engine, ids, param)


def check_ids(engine: Engine, ids: list[int], param: str) -> list[int]:
    """Ids the model embeds: in [0, vocab) (a tokenizer's added tokens may lie above it), and
    no more than the prompt limit."""
    vocab = engine.vocab_size
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
    if bad is not None:
        message = f"{param}: token {ids[bad]} at position {bad} is outside the model's "
        raise ApiError(400, message + f"vocabulary [0, {vocab})", param=param)
    if len(ids) > engine.max_prompt_tokens:
        message = f"the prompt is {len(ids)} tokens; at most {engine.max_prompt_tokens} are served"
        raise ApiError(400, message, param=param, code="context_length_exceeded")
    return ids


def completion_prompt(engine: Engine, prompt) -> list[int]:
    """A string, one string in a list, token ids, or one list of token ids in a list."""
    if isinstance(prompt, str):
        return encode(engine, prompt, "prompt")
    if len(prompt) > 1 and not all(isinstance(p, int) for p in prompt):
        raise ApiError(400, "prompt: one prompt per request (batch size 1)", param="prompt")
    if not prompt or prompt[0] in ("", []):
        raise ApiError(400, "prompt: the prompt is empty", param="prompt")
    if isinstance(prompt[0], str):
        return encode(engine, prompt[0], "prompt")
    ids = prompt[0] if isinstance(prompt[0], list) else prompt
    return check_ids(engine, list(ids), "prompt")


def check_context(prompt_tokens: int, max_tokens: int, context_length: int) -> None:
    """The prompt and the tokens asked for must fit the model's context (positions), as
    `moespec generate` checks it (moespec.models.context.fit_context)."""
    from moespec.models.context import ContextOverflowError, fit_context

    fix = "shorten the prompt or ask for fewer tokens (max_tokens)"
    try:
        fit_context(range(prompt_tokens), context_length, new_tokens=max_tokens, fix=fix)
    except ContextOverflowError as error:
        raise ApiError(
            400,
            f"this model's maximum context length is {context_length} tokens: {error}",
            param="max_tokens",
            code="context_length_exceeded",
        ) from None


def token_budget(engine: Engine, asked: int | None, prompt_tokens: int) -> int:
    limit = engine.max_tokens_limit
    if asked is None:
        asked = min(DEFAULT_MAX_TOKENS, limit, engine.context_length - prompt_tokens)
        asked = max(asked, 1)  # a prompt that fills the context is refused just below
    elif not 1 <= asked <= limit:
        raise ApiError(400, f"max_tokens must be in [1, {limit}], got {asked}", param="max_tokens")
    check_context(prompt_tokens, asked, engine.context_length)
    return asked


async def answer(engine: Engine, request: Request, prepared: Prepared, chat: bool):
    settings = prepared.settings
    seed = settings.seed if settings.seed is not None else secrets.randbits(63)
    # keyed: the same seed gives the same text, whatever the drafts (Sampler's docstring)
    sampler = Sampler(settings.temperature, settings.top_p, seed, keyed=True)
    try:
        engine.speculation.check(sampler)
    except ValueError as error:
        raise ApiError(400, str(error), param="temperature") from None
    loop = asyncio.get_running_loop()
    job = Job(
        prepared.prompt,
        settings.max_tokens,
        sampler,
        seed,
        prepared.stops,
        loop,
        adjust=settings.adjust,
        logprobs=settings.logprobs,
    )
    try:
        engine.submit(job)
    except QueueFull as full:
        raise too_busy(full) from None
    rid = protocol.new_id("chatcmpl" if chat else "cmpl")
    shape = LogprobShape(engine, chat) if settings.logprobs is not None else None
    if settings.stream:
        return StreamingResponse(
            stream(job, rid, engine.model_name, chat, shape), media_type="text/event-stream"
        )
    collect = asyncio.ensure_future(collect_text(job))
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not collect.done():
        job.cancel()
        collect.cancel()
        return Response(status_code=CLIENT_CLOSED)
    text, entries, done = collect.result()
    counts = protocol.usage(len(job.prompt), done["completion_tokens"])
    make = protocol.chat_body if chat else protocol.completion_body
    logprobs = shape(entries) if shape is not None else None
    return make(
        rid, engine.model_name, text, done["finish_reason"], counts, done["stats"], logprobs
    )


class LogprobShape:
    """TokenLogprob entries in the endpoint's own shape, token texts decoded once each."""

    def __init__(self, engine: Engine, chat: bool):
        self.tokenizer, self.chat, self.offset = engine.tokenizer, chat, 0

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def __call__(self, entries) -> dict:
        if self.chat:
            return protocol.chat_logprobs(entries, self.token_text)
        shaped = protocol.completion_logprobs(entries, self.token_text, self.offset)
        self.offset += sum(len(t) for t in shaped["tokens"])
        return shaped


async def events(job: Job):
    """The job's events until it is done; an engine error becomes a 500 (never bad input)."""
    while True:
        kind, value = await job.events.get()
        if kind == "error":
            raise ApiError(500, value, code="generation_failed")
        yield kind, value
        if kind == "done":
            return


async def collect_text(job: Job) -> tuple[str, list, dict]:
    pieces, entries = [], []
    async for kind, value in events(job):
        if kind == "text":
            pieces.append(value[0])
            entries.extend(value[1] or ())
        else:
            return "".join(pieces), entries, value
    raise AssertionError("unreachable: events end with done")


async def disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is already read: the next message is the
    disconnect, sent by the ASGI server when the connection closes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def stream(job: Job, rid: str, model: str, chat: bool, shape=None):
    """Server-sent events in the OpenAI chunk format; the last chunk carries the finish reason
    and usage. Leaving early (the client disconnected) cancels the job."""

    def sse(payload: dict) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    try:
        if chat:
            yield sse(protocol.chat_chunk(rid, model, {"role": "assistant", "content": ""}))
        try:
            async for kind, value in events(job):
                if kind == "text":
                    piece, entries = value
                    logprobs = shape(entries) if shape is not None and entries else None
                    yield sse(
                        protocol.chat_chunk(rid, model, {"content": piece}, logprobs=logprobs)
                        if chat
                        else protocol.completion_chunk(rid, model, piece, logprobs=logprobs)
                    )
                    continue
                counts = protocol.usage(len(job.prompt), value["completion_tokens"])
                reason = value["finish_reason"]
                yield sse(
                    protocol.chat_chunk(rid, model, {}, reason, counts)
                    if chat
                    else protocol.completion_chunk(rid, model, "", reason, counts)
                )
        except ApiError as error:
            yield sse(error.body())
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()  # no-op once the job is done


class BodyLimit:
    """ASGI middleware reading each request's body up to `limit` bytes before the app sees it.

    A Content-Length past the limit is refused with 413 before a byte is read; a body sent
    without one (chunked) is refused once it passes the limit; the rest of the body is never
    given to the app (`refuse`). The app receives the whole body, then the connection's own
    messages (its disconnect)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:  # a malformed one: the HTTP layer's
            return await self.refuse(scope, receive, send, f"{int(length)} bytes")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self.refuse(scope, receive, send, f"more than {self.limit} bytes")
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def refuse(self, scope, receive, send, size: str) -> None:
        """Send the whole 413 at once, then read and drop the rest of the body (up to
        DRAIN_BYTES) before ending the answer. A client reading as it sends has its 413 at
        once; one that reads after sending (most) gets it once its body is sent, not a reset
        connection: closing with unread bytes makes the kernel reset it, and the answer was lost."""
        message = f"the body is {size}; this server takes at most {self.limit} bytes"
        body = json.dumps(ApiError(413, message, code="request_too_large").body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": True})
        dropped = 0
        while dropped < DRAIN_BYTES:
            message = await receive()
            dropped += len(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class Admission:
    """ASGI middleware refusing a generation with 429 while the queue is full, before its body
    is parsed and before the framework routes it: a burst past the queue costs the event loop
    little, so /health and the clients being served are answered meanwhile."""

    ROUTES = ("/v1/completions", "/v1/chat/completions")

    def __init__(self, app, engine: Engine):
        self.app, self.engine = app, engine

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self.ROUTES:
            try:
                self.engine.check_room()
            except QueueFull as full:
                error = too_busy(full)
                response = JSONResponse(error.body(), status_code=429, headers=error.headers)
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class CountStatus:
    """ASGI middleware counting the HTTP status of every /v1/ answer into the metrics."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.count_request(message["status"])
            await send(message)

        await self.app(scope, receive, counted)


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request, error: ApiError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, error: RequestValidationError):
        return JSONResponse(validation_error(error.errors()).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException):
        return JSONResponse(
            ApiError(error.status_code, str(error.detail)).body(),
            status_code=error.status_code,
            headers=error.headers,
        )


def validation_error(errors) -> ApiError:
    """One OpenAI-style error naming the first problem of the body and where it is."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    where = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first.get('msg')}", code="json_invalid")
    if not where:  # the body itself: not an object, or not sent as JSON
        message = "the body must be a JSON object (Content-Type: application/json)"
        return ApiError(400, message, code=first.get("type"))
    param = ".".join(where) or None
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    return ApiError(400, message, param=param, code=first.get("type"))
