"""The model's context: what does not fit its positions is refused, or cut when asked.

A checkpoint's `max_position_embeddings` is how many positions it was trained on; past them
its rotary positions are ones it never saw and the output is noise, with no error. Every entry
point that feeds text to a model (generate, trace, plan, measure-verify, the server) calls
`fit_context` first, so an overlong prompt or document fails with one line naming the numbers
and the fix, or is truncated only when the caller asks:

    prompt = fit_context(prompt, model.config, new_tokens=128, truncate="none")

Pure Python: no torch, no I/O.
"""

from collections.abc import Sequence
from typing import Literal

from moespec.errors import SettingError, setting

Truncate = Literal["none", "left", "right"]
TRUNCATE_CHOICES = ("none", "left", "right")
DEFAULT_FIX = f"shorten it or pass {setting('truncate', 'left')} to keep its last {{keep}} tokens"


class ContextOverflowError(SettingError):
    """Tokens (plus the tokens still to generate) do not fit the model's context."""


def context_length(config) -> int:
    """The positions the model can attend over: config.json's max_position_embeddings."""
    return int(config.max_position_embeddings)


def fit_context(
    tokens: Sequence[int],
    config,
    *,
    new_tokens: int = 0,
    truncate: Truncate = "none",
    what: str = "the prompt",
    fix: str | None = DEFAULT_FIX,
) -> list[int]:
    """`tokens` if they and `new_tokens` more fit the context, else cut or refused.

    config: a ModelConfig (or anything with max_position_embeddings), or the context
    length as an int. truncate: "none" raises ContextOverflowError; "left" keeps the last
    tokens that fit (a prompt's end is what the continuation follows); "right" keeps the
    first (a document's beginning). what: names the tokens in the message ("the prompt",
    "document 'a.py'"). fix: the message's advice, with {keep} for the tokens that would
    fit (a setting in it as `moespec.errors.setting` writes it); a server passes its own.
    """
    if truncate not in TRUNCATE_CHOICES:
        raise ValueError(f"truncate must be one of {', '.join(TRUNCATE_CHOICES)}, got {truncate!r}")
    if new_tokens < 0:
        raise ValueError(f"new_tokens must be >= 0, got {new_tokens}")
    limit = config if isinstance(config, int) else context_length(config)
    keep = limit - new_tokens
    if keep < 1:
        raise ContextOverflowError(
            f"{new_tokens} tokens to generate leave no room for {what} in the model's context "
            f"of {limit} positions; ask for at most {limit - 1}"
        )
    if len(tokens) <= keep:
        return list(tokens)
    if truncate == "left":
        return list(tokens[len(tokens) - keep :])
    if truncate == "right":
        return list(tokens[:keep])
    asked = f" + {new_tokens} to generate" if new_tokens else ""
    advice = f"; {fix.format(keep=keep)}" if fix else ""
    raise ContextOverflowError(
        f"{what} has {len(tokens)} tokens{asked}, beyond the model's context of {limit} "
        f"positions (max_position_embeddings){advice}"
    )
