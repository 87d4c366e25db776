"""The checkpoint's tokenizer.json, read with `tokenizers`, and text streamed as it is decoded."""

from pathlib import Path

from tokenizers import Tokenizer as _Tokenizer

from moespec.models.checkpoint import CheckpointError


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

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def same_vocabulary(self, other: "Tokenizer") -> bool:
        """Token ids mean the same strings: required of a draft model and its target."""
        return self._tokenizer.get_vocab(True) == other._tokenizer.get_vocab(True)


class StreamingDetokenizer:
    """Text of a growing id sequence, emitted in pieces that never split a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = 0  # characters already returned

    def add(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for more
            return ""
        piece, self.emitted = text[self.emitted :], len(text)
        return piece

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids)
        piece, self.emitted = text[self.emitted :], len(text)
        return piece
