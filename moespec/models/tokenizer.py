"""The checkpoint's tokenizer.json, read with `tokenizers`, and text streamed as it is decoded."""

import functools
from pathlib import Path

from tokenizers import Tokenizer as _Tokenizer

from moespec.models.checkpoint import CheckpointError

# Texts longer than this are encoded as a batch of one, which encodes alike but releases the
# GIL: while a 1M-character text was encoded (1.1 s), a thread sleeping 2 ms in a loop woke 2
# times beside `encode`, 524 times beside `encode_batch`.
LONG_TEXT = 10_000


class Tokenizer:
    def __init__(self, path: str | Path):
        path = Path(path)
        if not path.exists():
            raise CheckpointError(f"{path} does not exist")
        try:
            self._tokenizer = _Tokenizer.from_file(str(path))
        except Exception as error:  # tokenizers raises a bare Exception on bad files
            raise CheckpointError(f"{path} is not a valid tokenizer.json: {error}") from None
        self.path = path

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def longest_token(self) -> int:
        """Characters of the vocabulary's longest token string (a byte-level token's string
        has a character per byte, so no decoded token is longer)."""
        return max((len(token) for token in self._tokenizer.get_vocab(True)), default=1)

    def encode(self, text: str) -> list[int]:
        if len(text) > LONG_TEXT:
            return self._tokenizer.encode_batch([text])[0].ids
        return self._tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def same_vocabulary(self, other: "Tokenizer") -> bool:
        """Token ids mean the same strings: required of a draft model and its target."""
        return self._tokenizer.get_vocab(True) == other._tokenizer.get_vocab(True)


class StreamingDetokenizer:
    """Text of a growing id sequence, emitted in pieces that never split a UTF-8 character.

    Incremental: each `add` decodes a window of the last few ids, not the whole sequence (a
    whole decode per step grew with the generation: at 2,048 tokens it cost more than a demo
    decode step). The window starts PREFIX ids before the newest ones, so a decoder that treats
    a decode's first token specially (a SentencePiece leading space) or merges bytes across
    tokens sees the same neighbours as in a whole decode; the text sent is the window's text
    past what was sent of it, up to a trailing incomplete character, which waits. The window
    moves on where its text ends on a whole character. `flush` decodes the whole sequence once
    and sends whatever it holds beyond the pieces sent.
    """

    PREFIX = 6  # ids decoded before the newest ones, for their context

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.start = 0  # the window's first id
        self.shown = 0  # characters of the window's text already sent
        self.sent: list[str] = []  # the pieces sent

    def add(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        decode = self.tokenizer.decode
        text = decode(self.ids[self.start :])
        end = len(text)
        while end > self.shown and text[end - 1] == "\ufffd":
            end -= 1  # an incomplete multi-byte character: it waits for its other bytes
        piece = text[self.shown : end]
        self.shown = max(self.shown, end)
        if end == len(text) and len(self.ids) - self.start > self.PREFIX:  # move the window on
            self.start = len(self.ids) - self.PREFIX
            self.shown = len(decode(self.ids[self.start :]))
        if piece:
            self.sent.append(piece)
        return piece

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids)
        sent = "".join(self.sent)
        piece = text[len(sent) :] if text.startswith(sent) else ""
        self.sent = [sent + piece]
        self.start, self.shown = len(self.ids), 0
        return piece
