"""The OpenAI wire format: request bodies (validated by pydantic, strictly typed), response and
chunk bodies, and the error body {"error": {"message", "type", "param", "code"}}.

Fields of the OpenAI API that moespec does not implement are accepted and ignored, except
where ignoring them would change the answer (n > 1, echo, best_of, suffix, tools,
response_format other than text, audio): those are refused with 400 naming the field.
"""

import time
import uuid
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from moespec.decoding.adjust import LogitAdjust


class ApiError(Exception):
    """An answer other than 200: HTTP status, message, and the OpenAI error type and code."""

    def __init__(self, status: int, message: str, *, param=None, code=None, headers=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    @property
    def kind(self) -> str:
        return {404: "not_found_error", 429: "rate_limit_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


MAX_STOPS, MAX_STOP_CHARACTERS = 4, 256  # OpenAI's bound on the count; ours on each length
MAX_LOGIT_BIAS = 100.0  # |bias|, as OpenAI bounds it
MAX_PENALTY = 2.0
MAX_LOGPROBS, MAX_TOP_LOGPROBS = 5, 20  # alternatives per token (completions, chat), as OpenAI


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool | None = None


@dataclass
class Settings:
    """A request's sampling settings with every default filled in."""

    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stops: list[str]
    stream: bool
    logprobs: int | None  # alternatives per token; None: no logprobs
    adjust: LogitAdjust | None


class Sampling(BaseModel):
    """Fields common to both endpoints. Strict types (no "12" for 12, no true for 1); null
    means the default for every optional field, as OpenAI's clients send it. Fields that would
    change the answer and are not implemented are refused by `check`, naming the field; others
    (user, metadata, store, ...) are accepted and ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None  # usage is always in the last chunk
    n: int | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS or any(not 0 < len(s) <= MAX_STOP_CHARACTERS for s in stops):
            message = f"stop: at most {MAX_STOPS} strings of 1 to {MAX_STOP_CHARACTERS} characters"
            raise ApiError(400, message, param="stop")
        return stops

    def settings(self, vocab_size: int) -> Settings:
        """Check every field's range and fill in the defaults; vocab_size bounds token ids."""
        _within("n", self.n, 1, 1, "only n = 1 is served (one completion per request)")
        _within("temperature", self.temperature, 0.0, 2.0)
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ApiError(400, f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        _within("seed", self.seed, -(2**63), 2**63 - 1)
        _within("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        _within("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        self.refuse_unserved()
        adjust = None
        bias = self.bias(vocab_size)
        presence, frequency = self.presence_penalty or 0.0, self.frequency_penalty or 0.0
        if bias or presence or frequency:
            adjust = LogitAdjust(bias, presence, frequency)
        return Settings(
            max_tokens=self.token_limit(),
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            stops=self.stop_strings(),
            stream=bool(self.stream),
            logprobs=self.logprob_count(),
            adjust=adjust,
        )

    def token_limit(self) -> int | None:
        return self.max_tokens

    def logprob_count(self) -> int | None:
        return None

    def refuse_unserved(self) -> None:
        """Fields that change the answer and are not implemented: 400 naming the field."""

    def bias(self, vocab_size: int) -> dict[int, float]:
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            where = f"logit_bias.{key}"
            if not key.isdigit() or not 0 <= int(key) < vocab_size:
                message = f"{where}: token ids must be integers in [0, {vocab_size})"
                raise ApiError(400, message, param="logit_bias")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                message = f"{where}: a bias must be in [-100, 100], got {value}"
                raise ApiError(400, message, param="logit_bias")
            bias[int(key)] = value
        return bias


def _within(name: str, value, low, high, message: str | None = None) -> None:
    if value is not None and not low <= value <= high:
        message = message or f"{name} must be in [{low}, {high}], got {value}"
        raise ApiError(400, message, param=name)


def _refuse(name: str, what: str) -> None:
    raise ApiError(400, f"{name}: {what} is not supported by this server", param=name)


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def logprob_count(self) -> int | None:
        _within("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        return self.logprobs

    def refuse_unserved(self) -> None:
        if self.echo:
            _refuse("echo", "echoing the prompt")
        _within("best_of", self.best_of, 1, 1, "best_of: only best_of = 1 is served")
        if self.suffix:
            _refuse("suffix", "a suffix (insertion)")


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None

    def text(self, where: str) -> str:
        if not isinstance(self.content, list):
            return self.content or ""
        pieces = []
        for i, part in enumerate(self.content):
            kind, text = part.get("type"), part.get("text")
            if kind != "text" or not isinstance(text, str):
                message = f"{where}.content.{i}: only text parts are served, got type {kind!r}"
                raise ApiError(400, message, param=f"{where}.content")
            pieces.append(text)
        return "".join(pieces)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None  # the chat API's newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    audio: dict | None = None
    modalities: list[str] | None = None

    def token_limit(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens

    def logprob_count(self) -> int | None:
        _within("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        if self.top_logprobs is not None and not self.logprobs:
            message = "top_logprobs needs logprobs: true"
            raise ApiError(400, message, param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def refuse_unserved(self) -> None:
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            _refuse("response_format", f"response_format {kind!r}")
        if self.tools or self.functions:
            _refuse("tools" if self.tools else "functions", "tool calling")
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none", "auto"):
                _refuse(name, "tool calling")
        if self.audio is not None or (self.modalities or ["text"]) != ["text"]:
            _refuse("audio" if self.audio is not None else "modalities", "audio output")

    def chat_messages(self) -> list[dict]:
        return [
            {"role": m.role, "content": m.text(f"messages.{i}")}
            for i, m in enumerate(self.messages)
        ]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(rid, model, text, finish_reason, counts, stats, logprobs=None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": counts,
        "moespec": stats,
    }


def chat_body(rid, model, text, finish_reason, counts, stats, logprobs=None) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        ],
        "usage": counts,
        "moespec": stats,
    }


def completion_chunk(rid, model, text, finish_reason=None, counts=None, logprobs=None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": counts,
    }


def chat_chunk(rid, model, delta, finish_reason=None, counts=None, logprobs=None) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": counts,
    }


def chat_logprobs(entries, token_text) -> dict:
    """OpenAI's chat shape: {"content": [{token, logprob, bytes, top_logprobs}], "refusal"}."""

    def one(token: int, logprob: float) -> dict:
        text = token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = [
        one(e.token, e.logprob) | {"top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(entries, token_text, offset: int = 0) -> dict:
    """The completions API's shape: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        tokens.append(token_text(e.token))
        offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{token_text(t): lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }
