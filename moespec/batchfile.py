"""Offline batch generation: a JSON-lines file of prompts decoded together, results written as
each finishes (`moespec generate --batch FILE.jsonl --out RESULTS.jsonl`).

Input: one JSON object per line, {"prompt": str, and optionally "id", "max_tokens",
"temperature", "top_p", "seed"} (blank lines skipped). A malformed line, or a prompt that does
not fit the context, becomes an error record naming its line; the others run.

Output: a header line {"batch": ..., "input_sha256": ...}, then one line per request as it
finishes: {"line", "id", "text", "prompt_tokens", "completion_tokens", "finish_reason",
"drafted", "accepted"} or {"line", "id", "error"}. Each line is written whole and flushed, so
an interrupted run keeps every request it finished; run again, it resumes (the header must be
this input's; a torn last line is dropped) and decodes only the lines not yet written. With
`force` the results start afresh.

Sampling is keyed (moespec.decoding.sampling.Sampler): a request's text depends on its seed
(its own, else the run's seed plus its line number) and not on which requests shared its
batch, whether it speculated, or whether the run was resumed.
"""

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from moespec.errors import SettingError, setting

FORMAT = "moespec-batch/1"
FIELDS = {"prompt": str, "id": object, "max_tokens": int, "temperature": float, "top_p": float}
FIELDS |= {"seed": int}


@dataclass
class Line:
    """One input line: its number (from 1) and the request's settings, or the error."""

    number: int
    settings: dict | None = None
    error: str | None = None


def read_lines(path: Path) -> list[Line]:
    """The file's requests, each checked; a bad line is kept as its error."""
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise ValueError(f"cannot read the batch file {path}: {error.strerror}") from None
    lines = []
    for number, text in enumerate(raw.split(b"\n"), start=1):
        if text.strip():
            lines.append(parse_line(number, text))
    if not lines:
        raise ValueError(f"the batch file {path} has no prompts")
    return lines


def parse_line(number: int, text: bytes) -> Line:
    try:
        value = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        return Line(number, error=f"line {number}: not a JSON object ({error})")
    if not isinstance(value, dict) or not isinstance(value.get("prompt"), str):
        return Line(number, error=f'line {number}: needs a "prompt" string')
    for name, kind in FIELDS.items():
        given = value.get(name)
        if given is None or kind is object:
            continue
        numeric = kind is float and isinstance(given, int) and not isinstance(given, bool)
        if not (isinstance(given, kind) and not isinstance(given, bool)) and not numeric:
            return Line(number, error=f"line {number}: {name} must be a {kind.__name__}")
    return Line(number, settings=value)


class Results:
    """The results file: its header checked (or written), the lines already done, and whole
    lines appended and flushed as requests finish."""

    def __init__(self, path: Path, header: dict, *, force: bool):
        self.path = path
        self.done: set[int] = set()
        if path.exists() and not force:
            self._resume(header)
        else:
            if not path.parent.exists():
                raise FileNotFoundError(f"directory {path.parent} does not exist (for {path})")
            path.write_text(json.dumps(header) + "\n")
        self.file = path.open("a")

    def _resume(self, header: dict) -> None:
        text = self.path.read_text()
        complete = text[: text.rfind("\n") + 1]  # a torn last line is dropped
        rows = [json.loads(line) for line in complete.splitlines() if line.strip()]
        if not rows or rows[0].get("input_sha256") != header["input_sha256"]:
            raise SettingError(
                f"{self.path} holds results of another batch file; start afresh with "
                f"{setting('force', True)} (it is overwritten) or choose another output"
            )
        self.done = {row["line"] for row in rows[1:]}
        if len(complete) < len(text):
            self.path.write_text(complete)

    def write(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()


@dataclass
class BatchSettings:
    model: str | None = None
    draft: str | None = "none"  # a drafter spec as `generate --draft`; "none": plain
    max_batch: int = 8
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    dtype: str = "bf16"
    kernel: str = "auto"
    draft_length: int | str = "auto"


def run_batch_file(
    path,
    out,
    settings: BatchSettings,
    *,
    force: bool = False,
    on_note: Callable[[str], None] | None = None,
    on_result: Callable[[dict], None] | None = None,
) -> dict:
    """Decode every request of the batch file not yet in `out`; return the run's counts."""
    from moespec.decoding import KernelPolicy
    from moespec.decoding.batch import decode_batch

    path, out = Path(path), Path(out)
    if settings.max_batch < 1:
        raise SettingError(f"{setting('max_batch')} must be >= 1, got {settings.max_batch}")
    lines = read_lines(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    results = Results(out, {"batch": FORMAT, "input_sha256": digest}, force=force)
    todo = [line for line in lines if line.number not in results.done]
    note = on_note or (lambda _: None)
    if results.done:
        note(f"resuming: {len(results.done)} of {len(lines)} requests are in {out}")
    loaded = Loaded.of(settings)
    counts = {"requests": len(lines), "resumed": len(results.done), "finished": 0, "errors": 0}

    def write(row: dict) -> None:
        results.write(row)
        counts["errors" if "error" in row else "finished"] += 1
        if on_result is not None:
            on_result(row)

    try:
        requests = batch_requests(loaded, todo, settings, write)
        kernels = KernelPolicy(settings.kernel)
        for key, record in decode_batch(
            loaded.model, requests, max_batch=settings.max_batch, kernels=kernels
        ):
            line, records = key
            records.append(record)
            if record.finish_reason is not None:
                write(result_row(loaded, line, records))
    finally:
        results.close()
    return counts


@dataclass
class Loaded:
    """The model, its tokenizer and speculation (per request, as a server builds it)."""

    model: object
    tokenizer: object
    speculation: object
    context_length: int

    @classmethod
    def of(cls, settings: BatchSettings) -> "Loaded":
        from moespec.models import load_model
        from moespec.serve.speculation import build_speculation
        from moespec.session import model_and_draft

        model_dir, draft = model_and_draft(settings.model, settings.draft)
        model, tokenizer = load_model(model_dir, dtype=settings.dtype)
        model.batch_invariant = True  # each sequence's tokens those it decodes alone
        speculation = build_speculation(
            draft,
            target=model,
            tokenizer=tokenizer,
            dtype=settings.dtype,
            draft_length=settings.draft_length,
        )
        return cls(model, tokenizer, speculation, model.config.max_position_embeddings)


def batch_requests(loaded, lines: list[Line], settings: BatchSettings, write) -> Iterator:
    """BatchRequests of the lines, read lazily; a line that cannot run is written as its
    error record instead."""
    from moespec.decoding import Sampler
    from moespec.decoding.batch import BatchRequest

    for line in lines:
        if line.error is not None:
            write({"line": line.number, "id": None, "error": line.error})
            continue
        given = line.settings
        request_id = given.get("id")
        try:
            prompt = loaded.tokenizer.encode(given["prompt"])
            max_tokens = given.get("max_tokens") or settings.max_tokens
            check_fits(loaded, line.number, prompt, max_tokens)
            seed = given.get("seed", settings.seed + line.number)
            temperature = given.get("temperature", settings.temperature)
            sampler = Sampler(temperature, given.get("top_p", settings.top_p), seed, keyed=True)
        except ValueError as error:
            write({"line": line.number, "id": request_id, "error": str(error)})
            continue
        yield BatchRequest(
            key=(line, []),  # the line, and its records as they come
            prompt=prompt,
            max_tokens=max_tokens,
            sampler=sampler,
            drafter=loaded.speculation.drafter(sampler, prompt, max_tokens, seed),
            stop_tokens=tuple(loaded.model.config.eos_token_ids),
        )


def check_fits(loaded, number: int, prompt: list[int], max_tokens: int) -> None:
    if not prompt:
        raise ValueError(f"line {number}: the prompt encodes to no tokens")
    if max_tokens < 1:
        raise ValueError(f"line {number}: max_tokens must be >= 1, got {max_tokens}")
    if len(prompt) + max_tokens > loaded.context_length:
        raise ValueError(
            f"line {number}: {len(prompt)} prompt tokens and {max_tokens} new ones do not fit "
            f"the model's context of {loaded.context_length}"
        )


def result_row(loaded, line: Line, records) -> dict:
    tokens = [t for r in records for t in r.tokens]
    decode = [r for r in records if r.phase == "decode"]
    return {
        "line": line.number,
        "id": line.settings.get("id"),
        "text": loaded.tokenizer.decode(tokens),
        "prompt_tokens": records[0].n_tokens,
        "completion_tokens": len(tokens),
        "finish_reason": records[-1].finish_reason,
        "drafted": sum(r.drafted for r in decode),
        "accepted": sum(r.accepted for r in decode),
    }
