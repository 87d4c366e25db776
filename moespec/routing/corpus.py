"""Documents to record routing on: text files (one document each) and JSONL (one per line).

A path is read by what it is: a folder gives every file under it (sorted, hidden ones skipped),
a `.jsonl` file gives one document per non-blank line (the text under `text_field`, the name
under `id_field` when the line has one), any other file is one document. Names identify
documents in a trace (and decide the fit/test split), so they must be unique:

    folder/sub/a.txt        -> "folder/sub/a.txt"   (the folder's own name, then the path in it)
    notes.txt               -> "notes.txt"
    wiki.jsonl, line 7      -> the line's "id", else "wiki.jsonl:7"
"""

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Document:
    name: str
    text: str


def read_corpus(
    paths: Iterable[str | Path], *, text_field: str = "text", id_field: str = "id"
) -> Iterator[Document]:
    """Yield the documents of every path in order; a repeated name is an error."""
    seen: dict[str, str] = {}
    for path in map(Path, paths):
        for source, document in _read_path(path, text_field, id_field):
            if document.name in seen:
                raise ValueError(
                    f"document name {document.name!r} appears twice ({seen[document.name]} "
                    f"and {source})"
                )
            seen[document.name] = source
            yield document


def _read_path(path: Path, text_field: str, id_field: str) -> Iterator[tuple[str, Document]]:
    if path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise ValueError(f"{path}: the corpus folder holds no files")
        for file in files:
            prefix = f"{path.name}/{file.relative_to(path).parent.as_posix()}/".replace("/./", "/")
            yield from _read_file(file, prefix, text_field, id_field)
    elif path.is_file():
        yield from _read_file(path, "", text_field, id_field)
    else:
        raise FileNotFoundError(f"{path}: no such corpus file or folder")


def _read_file(path: Path, prefix: str, text_field: str, id_field: str):
    text = _read_text(path)
    if path.suffix != ".jsonl":
        yield str(path), Document(prefix + path.name, text)
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not valid JSON ({error.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            raise ValueError(f"{where}: no string field {text_field!r}")
        name = record.get(id_field)
        name = str(name) if name is not None else f"{prefix}{path.name}:{number}"
        yield where, Document(name, record[text_field])


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text (byte {error.start})") from None
