"""Drafters: propose up to k tokens that continue a context.

- `ModelDrafter`: any checkpoint the engine loads (dense or MoE) sharing the target's tokenizer;
  its own KV cache follows the context and rolls back after rejections.
- `OracleDrafter` (seed 000 §4, App. D): proposes the target's own greedy token, corrupted with
  probability 1 - a by a seeded draw, so acceptance is geometric at rate a and drafting costs
  nothing — the instrument for measuring the staircase.
- `PromptLookupDrafter`: copies what followed the latest earlier occurrence of the context's
  last n-gram (n-gram matching in the context), a cheap real drafter.
"""

import time
from dataclasses import dataclass

import torch

from moespec.decoding.sampling import Sampler, greedy_tokens
from moespec.models import Tokenizer, Transformer


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), V] when sampled from a distribution
    catch_up: int = 0  # context tokens the draft pass fed beyond a steady step's two
    catch_up_seconds: float = 0.0  # the time of that pass (all of the feed)
    # S_1..S_k: the drafter's own chance that the first j tokens are all accepted, where it
    # knows one per proposal (the suffix drafter's counts); None: its acceptance is geometric
    survival: list[float] | None = None


class Drafter:
    """Interface: `propose(context, k)` returns at most k tokens continuing `context`."""

    name = "drafter"

    def propose(self, context: list[int], k: int) -> Draft:
        raise NotImplementedError


class ModelDrafter(Drafter):
    """A draft model decoding with its own cache and the target's sampler settings.

    With a keyed sampler of the target's seed, the draft at position t is the winner of the
    race on t's key over the draft's q: it agrees with the target's winner whenever the two
    distributions pick alike, and verification needs no q.

    It catches up lazily: steps it does not draft cost it nothing, and the next `propose` (or
    `catch_up`) feeds the tokens it missed in one batched pass. A catch-up of more than
    `max_catch_up` tokens starts its cache afresh on the context's last `max_catch_up`
    tokens: feeding every missed token made a probe after n plain steps cost n of the draft's
    tokens, so that probing alone took some 15% of the demo target's decode time (a draft
    token costs 57 us in a catch-up, a target step 0.37 ms). A draft only proposes; the
    target's verification keeps the output exact whatever context the draft saw.
    """

    name = "model"

    def __init__(
        self, model: Transformer, sampler: Sampler, vocab_size: int, max_catch_up: int | None = 32
    ):
        if max_catch_up is not None and max_catch_up < 2:
            raise ValueError(f"max_catch_up must be at least 2 tokens or None, got {max_catch_up}")
        self.model = model
        self.sampler = sampler
        self.vocab_size = vocab_size  # the target's: draft distributions are padded to it
        self.max_catch_up = max_catch_up  # None: always feed every missed token
        self.cache = model.new_cache()
        self.cached: list[int] = []  # the tokens whose keys/values the cache holds
        self.offset = 0  # the context position of cached[0]
        self.next_logits: torch.Tensor | None = None  # [V] after cached[-1]
        self.context: list[int] | None = None  # the context list of the last catch-up
        self.agreed = 0  # its length then: cached[:agreed] == that context[offset:]

    def catch_up(
        self, context: list[int], evidence: bool = False, first_window: int | None = None
    ) -> tuple[int, int]:
        """Feed the context's tokens the cache lacks, in one pass. Returns (fed, agreed):
        with `evidence`, agreed counts the fed positions whose greedy prediction equals the
        context's next token (free evidence on greedy acceptance); else 0. first_window: a
        first feed (an empty cache) is at most the context's last this many tokens, not all
        of it (a look at the draft that costs what it costs however long the prompt)."""
        # the cache holds context[offset:] as far as it agrees (offset > 0 after a fresh start)
        if self.offset >= len(context):  # a context that no longer reaches the window
            self.offset, self.cached, self.agreed = 0, [], 0
        offset, cached = self.offset, self.cached
        window = len(context) - offset
        # the same context list, grown by appending since the last catch-up, agrees with the
        # cache on the positions that catch-up fed: compare only past them (O(new tokens),
        # not O(generation))
        common = min(self.agreed, len(cached), window) if context is self.context else 0
        limit = min(len(cached), window)
        while common < limit and cached[common] == context[offset + common]:
            common += 1
        if common == window == len(cached) and self.next_logits is not None:
            return 0, 0
        common = min(common, window - 1)  # the last token is fed for its logits
        # the first feed (the prompt) is whole unless first_window says otherwise
        restart = self.max_catch_up if cached else first_window
        if restart is not None and window - common > restart:
            # a fresh cache on the context's last `restart` tokens
            self.offset = offset = len(context) - restart
            window, common = restart, 0
        self.cache.rollback(common)
        del cached[common:]
        feed = context[offset + common :]
        self.context, self.agreed = context, window
        kernel = "slot" if len(feed) <= 16 else "dedup"  # long feeds: the prompt
        logits = self.model(torch.tensor(feed), self.cache, kernel=kernel, all_logits=evidence)[0]
        self.cached.extend(feed)
        self.next_logits = logits[-1]
        if not evidence or len(feed) < 2:
            return len(feed), 0
        predicted = greedy_tokens(logits[:-1])
        return len(feed), sum(p == t for p, t in zip(predicted, feed[1:], strict=True))

    def draft_ahead(self) -> float:
        """Run one greedy one-token draft pass past the cache's end (the next token a greedy
        draft would propose second) and return its seconds: h(1) measured without a draft.
        A later catch-up keeps it if the context continues with that token, else rolls it
        back."""
        token = greedy_tokens(self.next_logits.reshape(-1))
        start = time.perf_counter()
        logits = self.model(torch.tensor([token]), self.cache, kernel="slot")[0, -1]
        seconds = time.perf_counter() - start
        self.cached.append(token)
        self.next_logits = logits
        return seconds

    def propose(self, context: list[int], k: int) -> Draft:
        if k == 0:
            return Draft([])
        start = time.perf_counter()
        fed, _ = self.catch_up(context)
        fed_seconds = time.perf_counter() - start
        logits = self.next_logits
        tokens, probs = [], []
        for i in range(k):
            if self.sampler.greedy:
                token = greedy_tokens(logits.reshape(-1))
            elif self.sampler.keyed:  # coupled: the race on the target's keys (no q needed)
                p = self._padded(self.sampler.probabilities(logits))
                token = self.sampler.race(p, len(context) + i)[0]
            else:
                p = self._padded(self.sampler.probabilities(logits))
                token = self.sampler.draw(p)
                probs.append(p)
            tokens.append(token)
            if i + 1 < k:
                logits = self.model(torch.tensor([token]), self.cache, kernel="slot")[0, -1]
                self.cached.append(token)
                self.next_logits = logits
        probs = torch.stack(probs) if probs else None
        return Draft(tokens, probs, max(fed - 2, 0), fed_seconds)

    def _padded(self, probs: torch.Tensor) -> torch.Tensor:
        if probs.shape[-1] == self.vocab_size:
            return probs
        out = probs.new_zeros(self.vocab_size)
        n = min(self.vocab_size, probs.shape[-1])
        out[:n] = probs[:n]
        return out / out.sum()


class OracleDrafter(Drafter):
    """Proposes `reference[len(context) - offset + i]`, the target's greedy continuation,
    each draft replaced by a different token with probability 1 - acceptance (seeded).

    The reference comes from batch-one greedy decoding. A verify pass of k + 1 tokens can round
    differently (bf16 near-ties), emit another token, and leave the reference behind; with
    `resync(context, n)` (the target's greedy continuation of a context) the oracle then
    re-derives its reference from the emitted context, so acceptance stays geometric at rate a.
    That work happens inside `propose` and is the oracle's, not the draft's of seed 000 (which
    costs nothing): benchmarks count verify time only.

    positional: common random numbers. Each position of the continuation gets one uniform u_p
    and one replacement shift, drawn once from the seed; the draft at position p is wrong
    exactly when u_p >= acceptance. Runs with other draft lengths or acceptances on the same
    seed then see the same flags (a sweep's cells differ only in what they vary), and a
    position re-proposed after a rejection keeps its flag. Each step's accepted run is still
    geometric at rate a: the positions after a rejected draft were never verified. Without it,
    each proposed draft draws a fresh flag.

    alternatives: what a wrong draft proposes. None (the default): the reference token shifted
    by a uniform amount, a token drawn from the whole vocabulary. A list aligned with the
    reference (`runner_up_tokens`: the target's best token other than the greedy one, which is
    what a draft model's mistake looks like): a wrong draft at position p proposes
    alternatives[p]. Seed 000 says only that the oracle "corrupts" a draft. The reading
    matters to a deduplicating verify pass, which pays for the experts its tokens route to: on
    OLMoE shapes a pass of 9 tokens with wrong drafts at a = 0.5 took 1.067x the time of the
    greedy tokens' pass with uniform tokens, 1.035x with runner-up ones, which route more
    like text, as the prediction's U(n) assumes (`benchmarks/corruption_cost.py`).
    `alternatives_for(context, tail)` gives the alternatives of a tail that `resync`
    re-derived; without it, the tail's wrong drafts are shifted.
    """

    name = "oracle"

    def __init__(
        self,
        reference: list[int],
        prompt_length: int,
        acceptance: float,
        vocab_size: int,
        seed: int = 0,
        resync=None,
        positional: bool = False,
        alternatives: list[int] | None = None,
        alternatives_for=None,
    ):
        if not 0 <= acceptance <= 1:
            raise ValueError(f"oracle acceptance must be in [0, 1], got {acceptance}")
        self.reference = list(reference)
        if alternatives is not None:
            alternatives = list(alternatives)
            if len(alternatives) != len(self.reference):
                raise ValueError(
                    f"oracle alternatives: {len(alternatives)} for a reference of "
                    f"{len(self.reference)} tokens"
                )
            pairs = enumerate(zip(alternatives, self.reference, strict=True))
            same = next((i for i, (a, t) in pairs if a == t), None)
            if same is not None:
                raise ValueError(f"oracle alternatives: position {same} is the reference token")
        self.alternatives = alternatives
        self.alternatives_for = alternatives_for
        self.prompt_length = prompt_length
        self.acceptance = acceptance
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)
        self.resync = resync
        self.resyncs = 0
        self.flags = None
        if positional:
            size = len(self.reference)
            self.flags = (
                torch.rand(size, generator=self.generator).tolist(),
                torch.randint(1, max(vocab_size, 2), (size,), generator=self.generator).tolist(),
            )

    def _follow(self, context: list[int]) -> None:
        """Re-derive the reference if the emitted context has left it."""
        emitted = context[self.prompt_length :]
        if self.resync is None or emitted == self.reference[: len(emitted)]:
            return
        remaining = len(self.reference) - len(emitted)
        tail = self.resync(context, remaining) if remaining > 0 else []
        self.reference = emitted + tail
        if self.alternatives is not None:
            kept = self.alternatives[: len(emitted)]
            if self.alternatives_for is not None and tail:
                self.alternatives = kept + list(self.alternatives_for(context, tail))
            else:  # None: the tail's wrong drafts are shifted
                self.alternatives = kept + [None] * len(tail)
        self.resyncs += 1

    def propose(self, context: list[int], k: int) -> Draft:
        self._follow(context)
        start = len(context) - self.prompt_length  # index of the next reference token
        tokens = []
        for i in range(k):
            if start + i >= len(self.reference):
                break
            token = self.reference[start + i]
            if self.flags is not None:
                uniform, shift = self.flags[0][start + i], self.flags[1][start + i]
            else:
                uniform = torch.rand((), generator=self.generator).item()
                shift = None
            if uniform >= self.acceptance:
                alternative = self.alternatives[start + i] if self.alternatives else None
                if alternative is not None:
                    tokens.append(alternative)
                    continue
                if shift is None:
                    shift = int(torch.randint(1, self.vocab_size, (), generator=self.generator))
                token = (token + shift) % self.vocab_size
            tokens.append(token)
        return Draft(tokens)


class PromptLookupDrafter(Drafter):
    """n-gram lookup in the context: the longest suffix (max_ngram down to min_ngram tokens)
    that occurred before proposes the tokens that followed its latest occurrence.

    An index {n-gram: latest start} grows with the context, so a proposal costs O(k) however
    long the context (a scan would cost O(length) per step); a context that is not the
    continuation of the last one rebuilds it.
    """

    name = "lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.context: list[int] | None = None
        self.indexed = 0  # n-grams ending before this position are in the index
        self.index: dict[tuple[int, ...], int] = {}

    def _extend_index(self, context: list[int]) -> None:
        if context is not self.context or len(context) < self.indexed:
            self.context, self.indexed, self.index = context, 0, {}
        # Index the n-grams ending at positions <= len - 2: each has a token after it, and
        # the context's own suffix (ending at len - 1) is not its own earlier occurrence.
        for end in range(self.indexed, len(context) - 1):
            for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
                self.index[tuple(context[end - n + 1 : end + 1])] = end - n + 1
        self.indexed = max(self.indexed, len(context) - 1)

    def propose(self, context: list[int], k: int) -> Draft:
        if k == 0:
            return Draft([])
        self._extend_index(context)
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            start = self.index.get(tuple(context[-n:]))
            if start is not None:
                return Draft(context[start + n : start + n + k])
        return Draft([])


def check_same_tokenizer(target: Tokenizer, draft: Tokenizer, draft_path) -> None:
    if not target.same_vocabulary(draft):
        raise ValueError(
            f"the draft model at {draft_path} has a different tokenizer vocabulary than the "
            "target; a draft must share the target's tokenizer"
        )
