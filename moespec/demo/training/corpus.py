"""The corpus: the interpreter's own standard-library sources, split into training and
held-out files (`moespec.demo.corpus` defines which), with a fingerprint of the text."""

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from moespec.demo.corpus import (  # the corpus definition moespec measures on
    is_held_out,
    list_corpus_files,
    stdlib_root,
)

EOS_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class Document:
    """One source file: its path relative to the stdlib root (POSIX form) and its text."""

    path: str
    text: str


@dataclass(frozen=True)
class Corpus:
    """The stdlib corpus split into training and held-out documents, both in sorted order."""

    root: str
    train: tuple[Document, ...]
    held_out: tuple[Document, ...]
    fingerprint: str


def corpus_fingerprint(docs: Sequence[Document]) -> str:
    """sha256 over the sorted (path, content) pairs, length-prefixed so it cannot alias."""
    h = hashlib.sha256()
    for doc in sorted(docs, key=lambda d: d.path):
        for blob in (doc.path.encode("utf-8"), doc.text.encode("utf-8")):
            h.update(len(blob).to_bytes(8, "big"))
            h.update(blob)
    return h.hexdigest()


def build_corpus(root: Path | None = None) -> Corpus:
    """Read the corpus files (UTF-8, as the stdlib is) and split them train / held-out."""
    root = stdlib_root() if root is None else Path(root)
    docs = [
        Document(rel, (root / rel).read_text(encoding="utf-8")) for rel in list_corpus_files(root)
    ]
    return Corpus(
        root=str(root),
        train=tuple(d for d in docs if not is_held_out(d.path)),
        held_out=tuple(d for d in docs if is_held_out(d.path)),
        fingerprint=corpus_fingerprint(docs),
    )
