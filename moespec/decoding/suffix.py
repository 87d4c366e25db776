"""The suffix drafter: the continuation of the longest earlier match of the context's end, over
the prompt, the text generated so far and optional corpus files, with a per-position chance of
acceptance counted from how often that continuation followed the match.

The idea is suffix decoding's (SuffixDecoding; Arctic Inference): text that quotes, repeats or
edits what came before is drafted by matching, and the draft is as long as the counts make it
likely. This is our own structure, chosen for a decode step of a quarter of a millisecond:

- Matches are found by hashed n-grams at the lengths `LEVELS` (1, 2, 3, 4, 8, 16 and
  32 tokens), not by an exact suffix tree: "the longest match" is the longest of these lengths
  whose n-gram ending the context occurred before. A polynomial hash over prefixes (mod 2^64)
  gives each level's n-gram ending at a position in two multiplications, so indexing one more
  token costs one hash and one table store per level, whatever the context's length (in C,
  `NativeIndex`, where the native library is built; `ContextIndex` is the reference), and
  matching is a binary search over the levels (a match at n tokens implies one at every shorter
  level). A hash collision can only cost a rejected draft: verification keeps the output exact.
- Each level keeps, per n-gram, its latest end and, per position, the previous end of the same
  n-gram (a chain of occurrences, newest first). A proposal follows the chain of its match over
  at most `OCCURRENCES` occurrences and counts, position by position, how many continued as the
  proposal does: that is "how often that continuation followed".
- The proposal's first token is the one most of those occurrences continued with (the newest
  on a tie), and the rest copy the newest occurrence that did so. Text past the context's end is
  the proposal itself, so a loop with a period shorter than the draft continues round it.
- The chance that draft position j is accepted given the ones before it is the share of the
  occurrences that agreed up to j - 1 and also agree at j, smoothed towards a prior learned from
  outcomes at the match's level (`LevelPrior`): p_j = (agree_j + w a_level) / (agree_{j-1} + w),
  then scaled by what that level's chances turned out to be worth (accepted positions over the
  chances given them: the counts of a one-token match promise more than it keeps).
  The survival S_j = p_1 ... p_j enters the cost model in place of geometric acceptance: a
  draft of k tokens is expected to emit 1 + S_1 + ... + S_k tokens (seed 000's G_a(k) is the
  geometric case S_j = a^j), so the draft length is chosen per step from the counts, and a weak
  match (S_1 small) drafts nothing.

Corpus files (`CorpusIndex`) are tokenized once and indexed in numpy: per level, the sorted
hashes of every n-gram with its end position, searched by `np.searchsorted`. A corpus larger
than `MAX_CORPUS_TOKENS` is read as a stream and indexed up to that many tokens; the note says
how much.
"""

import ctypes
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moespec.decoding.drafters import Draft, Drafter

LEVELS = (1, 2, 3, 4, 8, 16, 32)  # the n-gram lengths matched
OCCURRENCES = 8  # the latest occurrences of a match whose continuations are counted
PRIOR_WEIGHT = 2.0  # pseudo-occurrences of a level's learned acceptance in p_j
PRIOR_FORGETTING = 0.98  # weight kept by a level's past outcomes per new outcome
MAX_CHANCE = 0.995  # a calibrated chance never reaches certainty
MAX_CORPUS_TOKENS = 1 << 22  # tokens of corpus files indexed at most (4M: ~0.45 GB of index)
CORPUS_CHUNK_BYTES = 1 << 20  # corpus text is read and tokenized this many bytes at a time

_MASK = (1 << 64) - 1
_BASE = 0x9E3779B97F4A7C15  # odd: a unit mod 2^64
_POWERS = [pow(_BASE, n, 1 << 64) for n in range(max(LEVELS) + 1)]


class LevelPrior:
    """Per match level, what outcomes (verified drafts and proposals scored against the emitted
    tokens) taught, forgetting old ones at PRIOR_FORGETTING per outcome:

    - a Beta estimate of the chance a drafted position is accepted (`mean`), the prior that
      smooths the occurrences' counts; starts at 1/2 with the weight of two outcomes;
    - a calibration (`calibration`): the positions accepted over the chances the counts gave
      them. One earlier occurrence that agreed says 2/3 at any level, but a single earlier
      match of one token continued as before about one time in four on the demo target's text;
      the survival is scaled by what each level's counts turned out to be worth.
    """

    def __init__(self):
        n = len(LEVELS)
        self.accepted, self.rejected = [1.0] * n, [1.0] * n
        self.said, self.came = [0.0] * n, [0.0] * n  # sums of chances given, and accepted

    def mean(self, level: int) -> float:
        return self.accepted[level] / (self.accepted[level] + self.rejected[level])

    def calibration(self, level: int) -> float:
        """Accepted positions over the chances given them (1 before any outcome)."""
        return (self.came[level] + 1.0) / (self.said[level] + 1.0)

    def observe(self, level: int, agreed: int, failed: int, chances=()) -> None:
        """`agreed` positions accepted, then `failed` (0 or 1) rejected; chances: the
        uncalibrated chance the counts gave each of those positions."""
        keep = PRIOR_FORGETTING ** (agreed + failed)
        self.accepted[level] = self.accepted[level] * keep + agreed
        self.rejected[level] = self.rejected[level] * keep + failed
        seen = list(chances[: agreed + failed])
        if seen:
            self.said[level] = self.said[level] * keep + sum(seen)
            self.came[level] = self.came[level] * keep + agreed

    def remember(self, weight: float) -> list[list[float]]:
        """[[accepted, rejected, said, came], ...] per level, at most `weight` outcomes each."""
        out = []
        for level in range(len(LEVELS)):
            a, b = self.accepted[level], self.rejected[level]
            scale = min(1.0, weight / (a + b))
            out.append([a * scale, b * scale, self.said[level] * scale, self.came[level] * scale])
        return out

    def restore(self, levels) -> None:
        """Take remembered levels (`remember`); anything malformed is left out."""
        if not isinstance(levels, list) or len(levels) != len(LEVELS):
            return
        for level, values in enumerate(levels):
            if (
                isinstance(values, list)
                and len(values) == 4
                and all(isinstance(v, (int, float)) and v >= 0 for v in values)
                and values[0] > 0
                and values[1] > 0
            ):
                a, b, said, came = map(float, values)
                self.accepted[level], self.rejected[level] = a, b
                self.said[level], self.came[level] = said, came


class ContextIndex:
    """The n-grams of one growing token sequence, by level: each level's latest end per hash
    and the previous end of the n-gram ending at each position (-1: none). An n-gram is indexed
    once the token after it is known, so the sequence's own end is never its own match."""

    def __init__(self):
        self.tokens: list[int] = []
        self.prefix = [0]  # prefix[i]: the hash of tokens[:i]
        self.latest = [{} for _ in LEVELS]
        self.previous = [[] for _ in LEVELS]  # previous[level][end]
        self.indexed = 0  # n-grams ending before this position are indexed
        self._levels = [
            (n, _POWERS[n], latest, chain)
            for n, latest, chain in zip(LEVELS, self.latest, self.previous, strict=True)
        ]

    def extend(self, tokens) -> None:
        prefix, seq = self.prefix, self.tokens
        for t in tokens:
            prefix.append((prefix[-1] * _BASE + t + 1) & _MASK)
            seq.append(t)
        # index the n-grams ending at positions < len - 1: each has its next token
        for end in range(self.indexed, len(seq) - 1):
            stop = end + 1
            for n, power, latest, chain in self._levels:
                if n > stop:  # the sequence's first tokens: no n-gram that long yet
                    chain.append(-1)
                    continue
                key = (prefix[stop] - prefix[stop - n] * power) & _MASK
                chain.append(latest.get(key, -1))
                latest[key] = end
        self.indexed = max(self.indexed, len(seq) - 1)

    def suffix_hash(self, n: int) -> int:
        """The hash of the sequence's last n tokens."""
        end = len(self.tokens)
        return (self.prefix[end] - self.prefix[end - n] * _POWERS[n]) & _MASK

    def longest(self) -> int | None:
        """The highest level whose n-gram ending the sequence occurred before, or None."""
        length = len(self.tokens)
        low, high, found = 0, len(LEVELS) - 1, None
        while low <= high:
            mid = (low + high) // 2
            n = LEVELS[mid]
            if n < length and self.suffix_hash(n) in self.latest[mid]:
                found, low = mid, mid + 1
            else:
                high = mid - 1
        return found

    def occurrences(self, level: int, limit: int) -> list[int]:
        """The ends of the latest `limit` earlier occurrences of the level's n-gram ending the
        sequence, newest first."""
        end = self.latest[level].get(self.suffix_hash(LEVELS[level]), -1)
        chain, out = self.previous[level], []
        while end >= 0 and len(out) < limit:
            out.append(end)
            end = chain[end]
        return out


class NativeIndex:
    """`ContextIndex` in C (moespec/kernels/suffix.c): the same keys, matches and occurrence
    chains (tested against it), a few hash-table probes a token instead of some 6 us of Python
    on the demo's hot path. `tokens` stays a Python list: proposals read their continuations
    from it."""

    def __init__(self, lib):
        self._lib = lib
        levels = (ctypes.c_int64 * len(LEVELS))(*LEVELS)
        self._handle = lib.moespec_suffix_new(len(LEVELS), levels)
        if not self._handle:
            raise MemoryError("the suffix index: no memory")
        self.tokens: list[int] = []
        self._out = (ctypes.c_int64 * OCCURRENCES)()

    def __del__(self):
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            self._lib.moespec_suffix_free(handle)

    def extend(self, tokens) -> None:
        tokens = list(tokens)
        array = (ctypes.c_int64 * len(tokens))(*tokens)
        if self._lib.moespec_suffix_extend(self._handle, array, len(tokens)):
            raise MemoryError("the suffix index: no memory")
        self.tokens.extend(tokens)

    def suffix_hash(self, n: int) -> int:
        return self._lib.moespec_suffix_hash(self._handle, n)

    def longest(self) -> int | None:
        level = self._lib.moespec_suffix_longest(self._handle)
        return None if level < 0 else level

    def occurrences(self, level: int, limit: int) -> list[int]:
        out = self._out if limit <= OCCURRENCES else (ctypes.c_int64 * limit)()
        count = self._lib.moespec_suffix_occurrences(self._handle, level, limit, out)
        return out[:count]


def new_index():
    """The context index: in C where the native library is built, else `ContextIndex`."""
    from moespec.kernels.native import native

    lib = native().lib
    if lib is not None and hasattr(lib, "moespec_suffix_new"):
        return NativeIndex(lib)
    return ContextIndex()


def _hash_levels(tokens: np.ndarray) -> dict[int, np.ndarray]:
    """{n: hashes of the n-grams starting at 0 .. len - n} for every level n (uint64, the same
    polynomial hash `ContextIndex` computes: h(a + b) = h(a) B^b + h(b), wrapping mod 2^64)."""
    values = tokens.astype(np.uint64) + np.uint64(1)
    out = {1: values}
    with np.errstate(over="ignore"):
        for n in LEVELS[1:]:
            a = max(k for k in out if k < n and (n - k) in out)
            b = n - a
            out[n] = out[a][: len(values) - n + 1] * np.uint64(_POWERS[b]) + out[b][a:]
    return out


class CorpusIndex:
    """The n-grams of corpus files, by level: sorted hashes and the end position of each."""

    def __init__(self, tokens: np.ndarray, note: str):
        self.tokens = tokens.astype(np.int64)
        self.note = note
        self.keys, self.ends = [], []
        hashes = _hash_levels(self.tokens) if len(tokens) else {}
        for n in LEVELS:
            # n-grams with a token after them: those starting at 0 .. len - n - 1
            h = hashes[n][: max(len(tokens) - n, 0)] if hashes else np.zeros(0, np.uint64)
            order = np.argsort(h, kind="stable")
            self.keys.append(h[order])
            self.ends.append((order + n - 1).astype(np.int64))

    @classmethod
    def from_files(cls, paths, tokenizer, max_tokens: int = MAX_CORPUS_TOKENS) -> "CorpusIndex":
        """Index the text of `paths` (files, or directories whose files are read in name
        order), streamed in chunks, up to `max_tokens` tokens. Raises ValueError naming a path
        that is missing, empty, binary (NUL bytes or not UTF-8), or a directory without text."""
        files = []
        for path in map(Path, paths):
            if path.is_dir():
                found = sorted(p for p in path.rglob("*") if p.is_file())
                if not found:
                    raise ValueError(f"suffix corpus {path}: the directory holds no files")
                files += found
            elif path.is_file():
                files.append(path)
            else:
                raise ValueError(f"suffix corpus {path}: no such file or directory")
        pieces, count, total = [], 0, sum(f.stat().st_size for f in files)
        stopped = None  # the file where the limit was reached

        def take(text: str, path) -> None:
            nonlocal count, stopped
            ids = tokenizer.encode(text)
            if len(ids) > max_tokens - count:
                ids, stopped = ids[: max_tokens - count], path
            pieces.append(np.asarray(ids, dtype=np.int64))
            count += len(ids)

        for path in files:
            if path.stat().st_size == 0:
                raise ValueError(f"suffix corpus {path}: the file is empty")
            with open(path, "rb") as f:
                tail, offset = b"", 0
                while stopped is None and (chunk := f.read(CORPUS_CHUNK_BYTES)):
                    if b"\0" in chunk:
                        raise ValueError(f"suffix corpus {path}: binary (a NUL byte), not text")
                    chunk, tail = _split_utf8(tail + chunk)
                    cut = chunk.rfind(b"\n") + 1 if len(chunk) >= CORPUS_CHUNK_BYTES else 0
                    if cut:  # tokenize whole lines; the rest goes with the next chunk
                        chunk, tail = chunk[:cut], chunk[cut:] + tail
                    try:
                        take(chunk.decode("utf-8"), path)
                    except UnicodeDecodeError as error:
                        raise ValueError(
                            f"suffix corpus {path}: not UTF-8 text (byte {offset + error.start})"
                        ) from None
                    offset += len(chunk)
                if tail and stopped is None:
                    try:
                        take(tail.decode("utf-8"), path)
                    except UnicodeDecodeError:
                        raise ValueError(f"suffix corpus {path}: not UTF-8 text") from None
            if stopped is not None:
                break
        tokens = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
        if not len(tokens):
            raise ValueError(f"suffix corpus {', '.join(map(str, paths))}: no tokens")
        note = f"suffix corpus: {len(tokens):,} tokens from {len(files)} file(s)"
        if stopped is not None:
            note += (
                f", stopped in {stopped} at the limit of {max_tokens:,} tokens "
                f"({total / 2**20:.1f} MB in all)"
            )
        return cls(tokens, note)

    def longest(self, context: ContextIndex) -> int | None:
        """The highest level whose n-gram ending `context` occurs in the corpus, or None."""
        low, high, found = 0, len(LEVELS) - 1, None
        while low <= high:
            mid = (low + high) // 2
            n = LEVELS[mid]
            if n <= len(context.tokens) and self._range(mid, context.suffix_hash(n))[1]:
                found, low = mid, mid + 1
            else:
                high = mid - 1
        return found

    def _range(self, level: int, key: int) -> tuple[int, int]:
        keys = self.keys[level]
        key = np.uint64(key)
        start = int(np.searchsorted(keys, key, "left"))
        return start, int(np.searchsorted(keys, key, "right")) - start

    def occurrences(self, level: int, context: ContextIndex, limit: int) -> list[int]:
        """The ends of at most `limit` corpus occurrences of the level's n-gram ending `context`
        (the last ones in the corpus first)."""
        start, count = self._range(level, context.suffix_hash(LEVELS[level]))
        return self.ends[level][start : start + count][-limit:][::-1].tolist()


def _split_utf8(data: bytes) -> tuple[bytes, bytes]:
    """data cut before an incomplete UTF-8 character at its end: (whole, the rest)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:
            return data, b""
        if byte >= 0xC0:  # a lead byte: is its character complete?
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return (data, b"") if back >= need else (data[:-back], data[-back:])
    return data, b""


@dataclass
class Match:
    level: int  # index into LEVELS
    source: str  # "context" or "corpus"
    chances: list[float] | None = None  # each position's chance from the counts, uncalibrated


class SuffixDrafter(Drafter):
    """Drafts the continuation of the longest earlier match of the context's end (in the
    context, else the corpus; the longer match wins, the context on a tie) with its survival
    S_1..S_k (module docstring). The index follows the context incrementally: a context that
    continues the last one costs only its new tokens; any other rebuilds it."""

    name = "suffix"

    def __init__(self, corpus: CorpusIndex | None = None, prior: LevelPrior | None = None):
        self.corpus = corpus
        self.prior = prior or LevelPrior()
        self.index = new_index()
        self.last: Match | None = None  # the match of the latest proposal

    def _follow(self, context: list[int]) -> None:
        seen = self.index.tokens
        n = len(seen)
        if len(context) < n or (n and (context[n - 1] != seen[-1] or context[0] != seen[0])):
            self.index = new_index()
            n = 0
        if len(context) > n:
            self.index.extend(context[n:])

    def propose(self, context: list[int], k: int) -> Draft:
        self.last = None
        if k <= 0 or not context:
            return Draft([])
        self._follow(context)
        index = self.index
        level, source = index.longest(), "context"
        if self.corpus is not None:
            deeper = self.corpus.longest(index)
            if deeper is not None and (level is None or deeper > level):
                level, source = deeper, "corpus"
        if level is None:
            return Draft([])
        if source == "context":
            ends, tokens = index.occurrences(level, OCCURRENCES), index.tokens
        else:
            ends, tokens = self.corpus.occurrences(level, index, OCCURRENCES), self.corpus.tokens
        self.last = Match(level, source)
        return self._continue(ends, tokens, source == "context", k, level)

    def _continue(self, ends, tokens, wrap: bool, k: int, level: int) -> Draft:
        """The proposal after occurrences ending at `ends` of `tokens`: the context (a list,
        wrap), whose text past its end is the proposal itself, or the corpus (an array), which
        ends where it ends."""
        size = len(tokens)
        firsts = {}
        for end in ends:  # the most common next token, the newest occurrence on a tie
            if end + 1 < size:
                t = int(tokens[end + 1])
                firsts[t] = firsts.get(t, 0) + 1
        if not firsts:
            return Draft([])
        best = max(firsts.values())
        lead = next(e for e in ends if e + 1 < size and firsts.get(int(tokens[e + 1])) == best)
        proposal = self._read(tokens, lead, k, wrap)
        # per occurrence: how many of the proposal's tokens it continued with (its run), and
        # how far its continuation is known (all of it, but where the corpus ends)
        length = len(proposal)
        runs = [0] * (length + 2)  # runs[r]: occurrences with a run of exactly r
        short = [0] * (length + 2)  # short[n]: agreed with all n tokens known (n < length)
        for end in ends:
            follow = proposal if end == lead else self._read(tokens, end, length, wrap)
            run = 0
            if follow == proposal:
                run = length
            else:
                for a, b in zip(follow, proposal, strict=False):
                    if a != b:
                        break
                    run += 1
            runs[run] += 1
            if run == len(follow) < length:  # agreed as far as it is known
                short[run] += 1
        prior = PRIOR_WEIGHT * self.prior.mean(level)
        scale = self.prior.calibration(level)
        chances, survival, s = [], [], 1.0
        alive = len(ends)  # occurrences with runs >= j - 1
        for j in range(1, length + 1):
            seen = alive - short[j - 1]  # agreed up to j - 1 and known at j
            alive -= runs[j - 1]  # now: runs >= j, those that agree at j too
            chance = (alive + prior) / (seen + PRIOR_WEIGHT)
            chances.append(chance)
            s *= min(chance * scale, MAX_CHANCE)
            survival.append(s)
        self.last.chances = chances
        return Draft(proposal, survival=survival)

    @staticmethod
    def _read(tokens, end: int, k: int, wrap: bool) -> list[int]:
        """The k tokens after position `end`: in the context (wrap), running on into the
        proposal being read (a repeat of period p continues its last p tokens); in the corpus,
        up to its end."""
        if not wrap:
            return tokens[end + 1 : end + 1 + k].tolist()
        out = tokens[end + 1 : end + 1 + k]
        period = len(tokens) - end - 1
        while len(out) < k:  # the continuation's own tokens, a period back
            out.append(out[len(out) - period])
        return out

    def learn(self, agreed: int, failed: int) -> None:
        """The outcome of the latest proposal: its first `agreed` tokens were accepted (or
        emitted), then `failed` (0 or 1) was not."""
        if self.last is not None:
            self.prior.observe(self.last.level, agreed, failed, self.last.chances or ())
