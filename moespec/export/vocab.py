"""A checkpoint's tokenizer.json as GGUF tokenizer metadata, so llama.cpp tokenizes alike.

llama.cpp's BPE vocabulary (`tokenizer.ggml.model = "gpt2"`) holds the byte-level token
strings by id, their types (normal, control for special added tokens, user-defined for other
added tokens, unused for ids the tokenizer lacks), the merges as "left right" strings in rank
order, and a named pre-tokenizer. The pre-tokenizer names are llama.cpp's
(src/llama-vocab.cpp): "gpt-2" runs the GPT-2 split regex, which is what a `ByteLevel`
pre-tokenizer with `use_regex` runs in `tokenizers`.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from moespec.models.checkpoint import CheckpointError
from moespec.models.config import ModelConfig

# GGUF token types (gguf.TokenType): written as plain ints so this module imports nothing heavy.
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5


@dataclass(frozen=True)
class Vocabulary:
    tokens: list[str]  # by id, padded to the model's vocab_size
    token_types: list[int]
    merges: list[str]
    pre_tokenizer: str
    eos_token_id: int | None
    bos_token_id: int | None
    pad_token_id: int | None

    def write(self, writer) -> None:
        """Add the tokenizer keys to a gguf.GGUFWriter."""
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(self.pre_tokenizer)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.token_types)
        writer.add_token_merges(self.merges)
        if self.eos_token_id is not None:
            writer.add_eos_token_id(self.eos_token_id)
        if self.bos_token_id is not None:
            writer.add_bos_token_id(self.bos_token_id)
        if self.pad_token_id is not None:
            writer.add_pad_token_id(self.pad_token_id)
        # moespec never adds a BOS token the checkpoint does not name.
        writer.add_add_bos_token(self.bos_token_id is not None)
        writer.add_add_eos_token(False)


def read_vocabulary(path: Path, config: ModelConfig, pad_token_id: int | None) -> Vocabulary:
    """The GGUF vocabulary of tokenizer.json at `path` (a byte-level BPE), or a
    CheckpointError naming what llama.cpp could not reproduce."""
    try:
        spec = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} is not valid JSON: {error}") from None
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise CheckpointError(
            f"{path}: tokenizer model {model.get('type')!r} cannot be exported to GGUF "
            "(a byte-level BPE is needed)"
        )
    if spec.get("normalizer") is not None:
        raise CheckpointError(f"{path}: a tokenizer with a normalizer cannot be exported to GGUF")
    pre = pre_tokenizer_name(spec, path)
    vocab = dict(model["vocab"])
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    for token_id, token in added.items():
        vocab[token["content"]] = token_id
    by_id = {i: text for text, i in vocab.items()}
    size = max(config.vocab_size, max(by_id) + 1)
    tokens, types = [], []
    for i in range(size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(CONTROL if added[i].get("special") else USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    special = {
        "eos_token_id": config.eos_token_ids[0] if config.eos_token_ids else None,
        "bos_token_id": config.bos_token_id,
        "pad_token_id": pad_token_id,
    }
    for key, token_id in special.items():
        if token_id is not None and not 0 <= token_id < size:
            raise CheckpointError(f"{path}: {key} {token_id} is outside the vocabulary ({size})")
    return Vocabulary(tokens=tokens, token_types=types, merges=merges, pre_tokenizer=pre, **special)


def pre_tokenizer_name(spec: dict, path: Path) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenization (only GPT-2's is recognised)."""
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        if pre.get("add_prefix_space"):
            raise CheckpointError(
                f"{path}: a ByteLevel pre-tokenizer with add_prefix_space cannot be exported"
            )
        return "gpt-2"
    raise CheckpointError(
        f"{path}: pre-tokenizer {json.dumps(pre)[:80]} cannot be exported to GGUF "
        "(supported: ByteLevel with the GPT-2 regex)"
    )
