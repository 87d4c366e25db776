"""Text of a request: prompts from chat messages, and decoded text cut at stop strings.

Chat prompts use the checkpoint's own chat template (`chat_template` in tokenizer_config.json,
or chat_template.jinja) when it has one; otherwise the plain template below, whose next
"\\nUser:" line is an implicit stop string.
"""

import json
from pathlib import Path

from moespec.models import StreamingDetokenizer, Tokenizer

PLAIN_ROLES = {"system": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}
PLAIN_STOP = "\nUser:"


def plain_chat_prompt(messages: list[dict]) -> str:
    """One "Role: content" line per message, then "Assistant:" for the reply."""
    lines = [f"{PLAIN_ROLES.get(m['role'], m['role'].title())}: {m['content']}" for m in messages]
    return "\n".join([*lines, "Assistant:"])


def read_chat_template(model_dir: Path) -> str | None:
    """The checkpoint's Jinja chat template, or None."""
    model_dir = Path(model_dir)
    jinja = model_dir / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    config = model_dir / "tokenizer_config.json"
    if not config.exists():
        return None
    try:
        template = json.loads(config.read_text()).get("chat_template")
    except json.JSONDecodeError as error:
        raise ValueError(f"{config} is not valid JSON: {error}") from None
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class ChatTemplate:
    """Messages to a prompt: the checkpoint's Jinja template (sandboxed), else the plain one."""

    def __init__(self, template: str | None, special_tokens: dict[str, str] | None = None):
        self.source = template
        self.special_tokens = special_tokens or {}
        self.compiled = None
        if template is not None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self.compiled = env.from_string(template)

    @property
    def implicit_stops(self) -> list[str]:
        return [] if self.compiled is not None else [PLAIN_STOP]

    def render(self, messages: list[dict]) -> str:
        if self.compiled is None:
            return plain_chat_prompt(messages)
        try:
            return self.compiled.render(
                messages=messages, add_generation_prompt=True, **self.special_tokens
            )
        except Exception as error:  # a template's raise_exception or its own bug
            raise ValueError(f"the chat template refused these messages: {error}") from None


def _raise(message: str):
    raise ValueError(message)


class StopMatcher:
    """Knuth-Morris-Pratt's automaton of one stop string, fed a character at a time: `state` is
    the length of the longest prefix of the stop that the text fed so far ends with. Each
    character costs O(1) amortised, so checking a stream is linear in its length whatever the
    stop's length (a suffix-against-prefix scan per step was quadratic in it)."""

    def __init__(self, stop: str):
        self.stop, self.state = stop, 0
        self.fallback = [0] * len(stop)  # longest proper border of stop[: i + 1]
        border = 0
        for i in range(1, len(stop)):
            while border and stop[i] != stop[border]:
                border = self.fallback[border - 1]
            if stop[i] == stop[border]:
                border += 1
            self.fallback[i] = border

    def feed(self, char: str) -> bool:
        """Advance by one character; True when the text now ends with the whole stop."""
        stop, state = self.stop, self.state
        if state == len(stop):
            state = self.fallback[state - 1]
        while state and char != stop[state]:
            state = self.fallback[state - 1]
        if char == stop[state]:
            state += 1
        self.state = state
        return state == len(stop)


class StopText:
    """Decoded text of a growing token sequence, cut before the first stop string.

    `add(tokens)` returns (new text safe to send, stopped). Text that could still begin a stop
    string is held back until the next tokens decide it. The stop that ends first is the one
    cut at.
    """

    def __init__(self, tokenizer: Tokenizer, stops: list[str]):
        self.detokenizer = StreamingDetokenizer(tokenizer)
        self.matchers = [StopMatcher(s) for s in stops if s]
        self.text = ""  # everything decoded so far
        self.sent = 0  # characters of `text` already returned
        self.fed = 0  # characters of `text` fed to the matchers

    def add(self, tokens: list[int]) -> tuple[str, bool]:
        self.text += self.detokenizer.add(tokens)
        return self._release()

    def finish(self) -> str:
        """The held-back rest, once generation has ended without a stop string."""
        self.text += self.detokenizer.flush()
        piece, stopped = self._release()
        if not stopped:
            piece, self.sent = piece + self.text[self.sent :], len(self.text)
        return piece

    def _release(self) -> tuple[str, bool]:
        for at in range(self.fed, len(self.text)):
            char = self.text[at]
            ended = [m for m in self.matchers if m.feed(char)]
            if ended:
                end = at + 1 - max(len(m.stop) for m in ended)  # the earliest start
                piece, self.sent = self.text[self.sent : end], end
                self.text, self.fed = self.text[:end], end
                return piece, True
        self.fed = len(self.text)
        held = max((m.state for m in self.matchers), default=0)
        end = len(self.text) - held
        piece, self.sent = self.text[self.sent : end], max(end, self.sent)
        return piece, False
