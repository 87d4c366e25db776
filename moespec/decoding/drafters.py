"""Drafters: propose up to k tokens that continue a context.

- `ModelDrafter`: any checkpoint the engine loads (dense or MoE) sharing the target's tokenizer;
  its own KV cache follows the context and rolls back after rejections.
- `OracleDrafter` (seed 000 §4, App. D): proposes the target's own greedy token, corrupted with
  probability 1 - a by a seeded draw, so acceptance is geometric at rate a and drafting costs
  nothing — the instrument for measuring the staircase.
- `PromptLookupDrafter`: copies what followed the latest earlier occurrence of the context's
  last n-gram (n-gram matching in the context), a cheap real drafter.
"""

from dataclasses import dataclass

import torch

from moespec.decoding.sampling import Sampler
from moespec.models import Tokenizer, Transformer


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), V] when sampled from a distribution


class Drafter:
    """Interface: `propose(context, k)` returns at most k tokens continuing `context`."""

    name = "drafter"

    def propose(self, context: list[int], k: int) -> Draft:
        raise NotImplementedError


class ModelDrafter(Drafter):
    """A draft model decoding with its own cache and the target's sampler settings."""

    name = "model"

    def __init__(self, model: Transformer, sampler: Sampler, vocab_size: int):
        self.model = model
        self.sampler = sampler
        self.vocab_size = vocab_size  # the target's: draft distributions are padded to it
        self.cache = model.new_cache()
        self.cached: list[int] = []  # the tokens whose keys/values the cache holds

    def propose(self, context: list[int], k: int) -> Draft:
        if k == 0:
            return Draft([])
        # Roll back to the longest prefix the cache shares with the context, feed the rest.
        common = 0
        limit = min(len(self.cached), len(context) - 1)
        while common < limit and self.cached[common] == context[common]:
            common += 1
        self.cache.rollback(common)
        self.cached = self.cached[:common]
        feed = context[common:]
        tokens, probs = [], []
        for _ in range(k):
            kernel = "slot" if len(feed) <= 16 else "dedup"  # long feeds: the prompt
            logits = self.model(torch.tensor(feed), self.cache, kernel=kernel)[0, -1]
            self.cached.extend(feed)
            if self.sampler.greedy:
                token = int(logits.argmax())
            else:
                p = self._padded(self.sampler.probabilities(logits))
                token = self.sampler.draw(p)
                probs.append(p)
            tokens.append(token)
            feed = [token]
        return Draft(tokens, torch.stack(probs) if probs else None)

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
    ):
        if not 0 <= acceptance <= 1:
            raise ValueError(f"oracle acceptance must be in [0, 1], got {acceptance}")
        self.reference = list(reference)
        self.prompt_length = prompt_length
        self.acceptance = acceptance
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)
        self.resync = resync
        self.resyncs = 0

    def _follow(self, context: list[int]) -> None:
        """Re-derive the reference if the emitted context has left it."""
        emitted = context[self.prompt_length :]
        if self.resync is None or emitted == self.reference[: len(emitted)]:
            return
        remaining = len(self.reference) - len(emitted)
        tail = self.resync(context, remaining) if remaining > 0 else []
        self.reference = emitted + tail
        self.resyncs += 1

    def propose(self, context: list[int], k: int) -> Draft:
        self._follow(context)
        start = len(context) - self.prompt_length  # index of the next reference token
        tokens = []
        for i in range(k):
            if start + i >= len(self.reference):
                break
            token = self.reference[start + i]
            corrupt = torch.rand((), generator=self.generator).item() >= self.acceptance
            if corrupt:
                shift = int(torch.randint(1, self.vocab_size, (), generator=self.generator))
                token = (token + shift) % self.vocab_size
            tokens.append(token)
        return Draft(tokens)


class PromptLookupDrafter(Drafter):
    """n-gram lookup in the context: the longest suffix (max_ngram down to min_ngram tokens)
    that occurred before proposes the tokens that followed its latest occurrence."""

    name = "lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, context: list[int], k: int) -> Draft:
        if k == 0:
            return Draft([])
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            suffix = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):
                if context[start : start + n] == suffix:
                    follow = context[start + n : start + n + k]
                    return Draft(list(follow))
        return Draft([])


def check_same_tokenizer(target: Tokenizer, draft: Tokenizer, draft_path) -> None:
    if not target.same_vocabulary(draft):
        raise ValueError(
            f"the draft model at {draft_path} has a different tokenizer vocabulary than the "
            "target; a draft must share the target's tokenizer"
        )
