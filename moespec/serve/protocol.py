"""The OpenAI wire format: request bodies (validated by pydantic), response and chunk bodies,
and the error body {"error": {"message", "type", "param", "code"}}.

Fields of the OpenAI API that moespec does not implement are accepted and ignored, except
where ignoring them would change the answer (n > 1, logprobs, echo, best_of): those are refused.
"""

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


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


class Sampling(BaseModel):
    """Fields common to both endpoints."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # the chat API's newer name for max_tokens
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False  # the last chunk always carries usage (stream_options ignored)
    n: int = 1

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ApiError(400, "stop: at most 4 non-empty strings", param="stop")
        return stops

    def check(self) -> None:
        if self.n != 1:
            raise ApiError(400, "n: only n = 1 is served (batch size 1)", param="n")
        if not 0 <= self.temperature <= 2:
            raise ApiError(400, "temperature must be in [0, 2]", param="temperature")
        if not 0 < self.top_p <= 1:
            raise ApiError(400, "top_p must be in (0, 1]", param="top_p")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ApiError(400, "seed must be in [0, 2**63)", param="seed")
        self.stop_strings()


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None

    def check(self) -> None:
        super().check()
        unsupported = {
            "echo": self.echo,
            "logprobs": self.logprobs is not None,
            "best_of": self.best_of not in (None, 1),
        }
        for name, asked in unsupported.items():
            if asked:
                raise ApiError(400, f"{name} is not supported", param=name)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False

    def check(self) -> None:
        super().check()
        if self.logprobs:
            raise ApiError(400, "logprobs is not supported", param="logprobs")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(rid, model, text, finish_reason, counts, stats) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": counts,
        "moespec": stats,
    }


def chat_body(rid, model, text, finish_reason, counts, stats) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": counts,
        "moespec": stats,
    }


def completion_chunk(rid, model, text, finish_reason=None, counts=None) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": counts,
    }


def chat_chunk(rid, model, delta, finish_reason=None, counts=None) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
        "usage": counts,
    }
