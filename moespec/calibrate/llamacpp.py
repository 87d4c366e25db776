"""llama.cpp as a measured engine, through `llama-cpp-python` (the optional `llamacpp` extra).

One GGUF model (see moespec.export.gguf) with one sequence in its KV cache, driven through the
package's low-level batch API so that a pass is exactly one `llama_decode` of n tokens:

- `forward(tokens)`: a pass of n tokens after the cached ones, with the logits of every row
  (a verification pass of seed 000: n = k + 1); `rollback(length)` removes what follows
  `length` from the KV cache, as a rejected draft is removed;
- `greedy(prompt, n)`: plain greedy decoding, one pass of one token per step;
- `measure_verify` / `measure_draft_time`: τ(n) on a cache of fixed depth and the draft cost
  h(k), in the record format of moespec.calibrate.verify, so both engines' tables compare.

The thread count of the model's passes is set per call (`threads`), so one loaded model serves
every thread count of a benchmark.
"""

import ctypes
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from moespec.calibrate.timing import median_iqr

F32_CACHE = 0  # ggml's GGML_TYPE_F32, for keys and values stored unrounded


def import_llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise ValueError(
            "llama.cpp is not installed: pip install -e '.[llamacpp]' (llama-cpp-python)"
        ) from None
    return llama_cpp


class LlamaCpp:
    """A GGUF model in llama.cpp with a KV cache of one sequence (`length` positions).
    context: the cache's capacity (0: the model's trained context)."""

    def __init__(
        self, path: str | Path, *, context: int = 0, threads: int = 1, exact_cache: bool = False
    ):
        llama_cpp = import_llama_cpp()
        if not Path(path).is_file():
            raise FileNotFoundError(f"{path}: no such GGUF file")
        cache = {"type_k": F32_CACHE, "type_v": F32_CACHE} if exact_cache else {}
        self.llm = llama_cpp.Llama(
            str(path),
            n_ctx=context,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
            **cache,
        )
        self._llama_cpp = llama_cpp
        self.path = Path(path)
        self._threads = threads
        self.vocab_size = self.llm.n_vocab()
        self._logit_types: dict[int, type] = {}

    @property
    def threads(self) -> int:
        return self._threads

    @threads.setter
    def threads(self, n: int) -> None:
        self._llama_cpp.llama_set_n_threads(self.llm.ctx, n, n)
        self._threads = n

    @property
    def length(self) -> int:
        return self.llm.n_tokens

    def forward(self, tokens: Sequence[int], *, all_logits: bool = True) -> np.ndarray:
        """One pass of len(tokens) tokens after the cache; float32 logits [n, V] (all rows)
        or [1, V] (the last)."""
        llm, n = self.llm, len(tokens)
        llm._batch.set_batch(batch=list(tokens), n_past=llm.n_tokens, logits_all=all_logits)
        llm._ctx.decode(llm._batch)
        llm.n_tokens += n
        rows = n if all_logits else 1
        return self._logits(rows).copy()

    def _logits(self, rows: int) -> np.ndarray:
        """A view of the context's logits buffer [rows, V] (ctypes array types cached: making
        one per call costs more than a small model's pass)."""
        if rows not in self._logit_types:
            self._logit_types[rows] = ctypes.c_float * (rows * self.vocab_size)
        pointer = self.llm._ctx.get_logits()
        buffer = self._logit_types[rows].from_address(ctypes.addressof(pointer.contents))
        return np.frombuffer(buffer, dtype=np.float32).reshape(rows, self.vocab_size)

    def rollback(self, length: int) -> None:
        """Keep the first `length` positions of the KV cache only."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: the cache holds {self.length}")
        self.llm._ctx.kv_cache_seq_rm(-1, length, -1)
        self.llm.n_tokens = length

    def reset(self) -> None:
        self.rollback(0)

    def prefill(self, tokens: Sequence[int]) -> np.ndarray:
        """A fresh cache holding `tokens` (in passes of the context's batch size); the last
        row's logits."""
        self.reset()
        batch = self.llm.n_batch
        for i in range(0, len(tokens), batch):
            logits = self.forward(tokens[i : i + batch], all_logits=False)
        return logits

    def greedy(self, prompt: Sequence[int], max_tokens: int) -> list[int]:
        """Plain greedy decoding from a fresh cache: max_tokens tokens, no stop token."""
        token = int(self.prefill(prompt)[-1].argmax())
        out = [token]
        while len(out) < max_tokens:
            token = int(self.forward([token], all_logits=False)[-1].argmax())
            out.append(token)
        return out


def measure_verify(
    engine: LlamaCpp,
    tokens: Sequence[int],
    *,
    depth: int = 256,
    pass_sizes: Sequence[int] = tuple(range(1, 10)),
    repeats: int = 10,
    warmup: int = 2,
) -> list[dict]:
    """[{kernel: "llamacpp", n_tokens, seconds, median, iqr, depth}]: verification passes of
    n tokens (the text's next tokens, every row's logits) on a cache of `depth` tokens, each
    removed from the cache after it; pass sizes interleave within each repeat."""
    need = depth + max(pass_sizes)
    if len(tokens) < need:
        raise ValueError(f"a verify measurement needs {need} tokens of text, got {len(tokens)}")
    engine.prefill(tokens[:depth])
    samples: dict[int, list[float]] = {n: [] for n in pass_sizes}
    for repeat in range(warmup + repeats):
        for n in pass_sizes:
            batch = list(tokens[depth : depth + n])
            start = time.perf_counter()
            engine.forward(batch)
            elapsed = time.perf_counter() - start
            engine.rollback(depth)
            if repeat >= warmup:
                samples[n].append(elapsed)
    return [
        {
            "kernel": "llamacpp",
            "n_tokens": n,
            "seconds": values,
            "median": m,
            "iqr": iqr,
            "depth": depth,
        }
        for n, values in samples.items()
        for m, iqr in [median_iqr(values)]
    ]


def measure_draft_time(
    draft: LlamaCpp,
    tokens: Sequence[int],
    *,
    depth: int = 256,
    max_draft_length: int = 8,
    repeats: int = 5,
) -> list[float]:
    """h(k), k = 0..k_max: median seconds for the draft to propose k greedy tokens after a
    context of `depth` tokens it has already seen (one pass of one token each; h(0) = 0)."""
    context = list(tokens[:depth])
    draft.prefill(context[:-1])
    times = [0.0]
    for k in range(1, max_draft_length + 1):
        values = []
        for _ in range(repeats + 1):
            draft.rollback(depth - 1)
            start = time.perf_counter()
            token = context[-1]
            for _ in range(k):
                token = int(draft.forward([token], all_logits=False)[-1].argmax())
            values.append(time.perf_counter() - start)
        times.append(median_iqr(values[1:])[0])
    return times


def round_flags(rng: np.random.Generator, length: int, vocab_size: int):
    """One sweep round's common random numbers for the oracle (`oracle_draft`): a uniform and a
    shift in 1..vocab-1 per position of the reference stream, shared by every (a, k) cell of
    the round, so that cells differ only in a and k."""
    return rng.random(length).tolist(), rng.integers(1, max(vocab_size, 2), length).tolist()


def oracle_draft(reference, first: int, k: int, acceptance: float, flags, vocab_size: int):
    """(draft, accepted): the oracle's k drafts from stream position `first` on the round's
    `flags` (uniforms, shifts). Position p's draft is accepted while uniforms[p] < acceptance
    (a geometric run at rate a); from the first one that is not, every draft of the pass is
    the stream's token shifted by shifts[p], so the pass routes as a rejected draft would. With
    the same flags a longer k keeps every accepted run a shorter k saw."""
    uniforms, shifts = flags
    draft = list(reference[first : first + k])
    accepted = 0
    while accepted < len(draft) and uniforms[first + accepted] < acceptance:
        accepted += 1
    for i in range(accepted, len(draft)):
        draft[i] = (draft[i] + shifts[first + i]) % vocab_size
    return draft, accepted


def versions() -> dict:
    """llama-cpp-python's version and llama.cpp's (its build commit is not exposed)."""
    llama_cpp = import_llama_cpp()
    return {
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp": llama_cpp.llama_version().decode(),
        "llama_cpp_commit": None,
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
    }
