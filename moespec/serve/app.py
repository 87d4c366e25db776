"""The HTTP layer: FastAPI routes over an `Engine`, in the OpenAI API's shapes.

POST /v1/completions, POST /v1/chat/completions (both with "stream": true as server-sent
events, closed by `data: [DONE]`), GET /v1/models, GET /health, GET /metrics (Prometheus text).
Every refusal is an OpenAI error body: 400 for bad input (malformed JSON included), 429 with
Retry-After when the queue is full; a client that disconnects cancels its generation.
"""

import asyncio
import json
import secrets
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from moespec import __version__
from moespec.decoding import Sampler
from moespec.serve import protocol
from moespec.serve.engine import Engine, Job, QueueFull
from moespec.serve.protocol import ApiError, ChatRequest, CompletionRequest

DEFAULT_MAX_TOKENS = 256
CLIENT_CLOSED = 499  # the request's status when its client left before the answer (as nginx)


def create_app(engine: Engine) -> FastAPI:
    app = FastAPI(title="moespec", version=__version__, docs_url=None, redoc_url=None)
    app.add_middleware(CountStatus, metrics=engine.metrics)
    add_error_handlers(app)
    created = int(time.time())

    @app.get("/health")
    def health():
        return {"status": "ok", "model": engine.model_name, "queue_length": engine.queue_length()}

    @app.get("/v1/models")
    def models():
        card = {
            "id": engine.model_name,
            "object": "model",
            "created": created,
            "owned_by": "moespec",
        }
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    def metrics():
        return PlainTextResponse(engine.render_metrics(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        body.check()
        prompt = completion_prompt(engine, body.prompt)
        return await answer(engine, request, body, prompt, body.stop_strings(), chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        body.check()
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = engine.chat_template.render(messages)
        except ValueError as error:
            raise ApiError(400, str(error), param="messages") from None
        prompt = encode(engine, text)
        stops = body.stop_strings() + engine.chat_template.implicit_stops
        return await answer(engine, request, body, prompt, stops, chat=True)

    return app


def encode(engine: Engine, text: str) -> list[int]:
    ids = engine.tokenizer.encode(text)
    if not ids:
        raise ApiError(400, "the prompt encodes to no tokens", param="prompt")
    return ids


def completion_prompt(engine: Engine, prompt) -> list[int]:
    """A string, one string in a list, or token ids."""
    if isinstance(prompt, str):
        return encode(engine, prompt)
    if prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise ApiError(400, "prompt: one prompt per request (batch size 1)", param="prompt")
        return encode(engine, prompt[0])
    vocab = engine.model.config.vocab_size
    if not prompt or any(not 0 <= t < vocab for t in prompt):
        raise ApiError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
    return list(prompt)


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


def token_budget(engine: Engine, body, prompt_tokens: int) -> int:
    asked = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
    limit = engine.max_tokens_limit
    if asked is None:
        asked = min(DEFAULT_MAX_TOKENS, limit, engine.context_length - prompt_tokens)
        asked = max(asked, 1)  # a prompt that fills the context is refused just below
    elif not 1 <= asked <= limit:
        raise ApiError(400, f"max_tokens must be in [1, {limit}], got {asked}", param="max_tokens")
    check_context(prompt_tokens, asked, engine.context_length)
    return asked


async def answer(engine: Engine, request: Request, body, prompt, stops, chat: bool):
    seed = body.seed if body.seed is not None else secrets.randbits(32)
    sampler = Sampler(body.temperature, body.top_p, seed)
    try:
        engine.speculation.check(sampler)
    except ValueError as error:
        raise ApiError(400, str(error), param="temperature") from None
    loop = asyncio.get_running_loop()
    max_tokens = token_budget(engine, body, len(prompt))
    job = Job(prompt, max_tokens, sampler, seed, stops, loop)
    try:
        engine.submit(job)
    except QueueFull as full:
        headers = {"Retry-After": str(full.retry_after)}
        raise ApiError(429, str(full), code="queue_full", headers=headers) from None
    rid = protocol.new_id("chatcmpl" if chat else "cmpl")
    if body.stream:
        return StreamingResponse(
            stream(job, rid, engine.model_name, chat), media_type="text/event-stream"
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
    text, done = collect.result()
    counts = protocol.usage(len(prompt), done["completion_tokens"])
    make = protocol.chat_body if chat else protocol.completion_body
    return make(rid, engine.model_name, text, done["finish_reason"], counts, done["stats"])


async def events(job: Job):
    """The job's events until it is done; an engine error becomes a 500 (never bad input)."""
    while True:
        kind, value = await job.events.get()
        if kind == "error":
            raise ApiError(500, value, code="generation_failed")
        yield kind, value
        if kind == "done":
            return


async def collect_text(job: Job) -> tuple[str, dict]:
    pieces = []
    async for kind, value in events(job):
        if kind == "text":
            pieces.append(value)
        else:
            return "".join(pieces), value
    raise AssertionError("unreachable: events end with done")


async def disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is already read: the next message is the
    disconnect, sent by the ASGI server when the connection closes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def stream(job: Job, rid: str, model: str, chat: bool):
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
                    delta = {"content": value}
                    yield sse(
                        protocol.chat_chunk(rid, model, delta)
                        if chat
                        else protocol.completion_chunk(rid, model, value)
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
