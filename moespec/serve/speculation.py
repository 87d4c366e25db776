"""What each request drafts with, built as `moespec generate` builds it
(moespec.decoding.setup): "auto" / "auto:DIR" chooses per step among the suffix drafter, the
draft model DIR and no draft; a checkpoint directory, "oracle:A", "suffix[:CORPUS]"
or "lookup" is that drafter alone (a corpus is indexed once, at start).

A draft checkpoint is loaded once at start. Each request gets fresh speculation state (its
own drafters, caches, acceptance estimates and seeded draft sampler), so an answer does not
depend on the requests before it, except through the target's verify times tau(n): those are
facts of the hardware, measured once for the whole server and shared by every request's
draft-length policies.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

from moespec.decoding import ModelDrafter, PromptLookupDrafter, Sampler
from moespec.decoding.draft_policy import RunningMedians
from moespec.decoding.remembered import Remembered
from moespec.decoding.setup import (
    draft_byte_ratio,
    draft_length_policy,
    draft_name,
    drafter_factory,
    load_draft_model,
    suffix_corpus,
)
from moespec.decoding.speculation import Option
from moespec.decoding.speculation import Speculation as Choice
from moespec.decoding.suffix import CorpusIndex, SuffixDrafter
from moespec.models import Tokenizer, Transformer


@dataclass
class Speculation:
    """draft: the drafter spec or None (plain decoding); draft_model: the loaded draft
    checkpoint of a directory or auto:DIR spec."""

    draft: str | None
    target: Transformer
    tokenizer: Tokenizer
    dtype: str
    draft_length: int | str = "auto"
    max_draft_length: int = 8
    plan: dict | None = None
    draft_model: Transformer | None = None
    draft_byte_ratio: float | None = None  # the draft model's bytes per token over the target's
    verify_times: RunningMedians = field(default_factory=RunningMedians)
    corpus: CorpusIndex | None = None  # the suffix drafter's corpus files, indexed
    remembered: Remembered | None = None  # measurements of earlier runs (`remember`)
    last: Choice | None = None  # the latest request's speculation

    def remember(self, remembered: Remembered) -> None:
        """Start from remembered measurements: the shared tau(n) now, each request's drafters
        from them; `write_back` keeps what the server measured."""
        self.remembered = remembered
        remembered.seed_verify_times(self.verify_times)

    def write_back(self) -> None:
        """Remember what the server measured (its tau(n), the latest request's drafters)."""
        if self.remembered is not None and self.last is not None:
            self.remembered.take(self.last)
            self.remembered.save()

    @property
    def name(self) -> str:
        """The draft as results name it ("auto:moespec/demo/draft" for the demo's), or "none"."""
        return "none" if self.draft is None else draft_name(self.draft)

    @property
    def draft_dir(self) -> str | None:
        if (
            self.draft is None
            or self.draft in ("auto", "lookup")
            or self.draft.startswith(("oracle", "suffix"))
        ):
            return None
        return self.draft.removeprefix("auto:")

    def check(self, sampler: Sampler) -> None:
        """Refuse a request this speculation cannot serve (before it is queued)."""
        if self.draft is not None and self.draft.startswith("oracle") and not sampler.greedy:
            raise ValueError("this server drafts with the oracle, which needs temperature 0")

    def drafter(
        self, sampler: Sampler, prompt: Sequence[int], max_tokens: int, seed: int
    ) -> Choice | None:
        """Fresh speculation for one request (None without a draft)."""
        if self.draft is None:
            return None
        vocab = self.target.config.vocab_size
        drafters = []
        auto = self.draft == "auto" or self.draft.startswith("auto:")
        if auto or self.draft == "suffix" or self.draft.startswith("suffix:"):
            drafters.append(SuffixDrafter(self.corpus))
        if self.draft == "lookup":
            drafters.append(PromptLookupDrafter())
        if self.draft_model is not None:
            # keyed: the draft races on the target's keys (coupled); else its own stream
            draft_seed = seed if sampler.keyed else seed + 1
            draft_sampler = Sampler(sampler.temperature, sampler.top_p, draft_seed, sampler.keyed)
            drafters.append(ModelDrafter(self.draft_model, draft_sampler, vocab))
        if not drafters:  # the oracle: its reference is this request's greedy continuation
            make = drafter_factory(
                self.draft,
                target=self.target,
                tokenizer=self.tokenizer,
                sampler=sampler,
                prompt=prompt,
                max_tokens=max_tokens,
                dtype=self.dtype,
                seed=seed,
            )
            drafters.append(make())
        options = {}
        for drafter in drafters:
            model_dir = self.draft_dir if isinstance(drafter, ModelDrafter) else None
            policy = draft_length_policy(
                self.draft_length, self.max_draft_length, self.plan, model_dir, self.verify_times
            )
            if isinstance(drafter, ModelDrafter):
                policy.draft_byte_ratio = self.draft_byte_ratio
            options[drafter.name] = Option(drafter, policy)
        choice = Choice(options)
        if self.remembered is not None:
            self.remembered.seed(choice, verify=False)
        self.last = choice
        return choice


def build_speculation(
    draft: str | None,
    *,
    target: Transformer,
    tokenizer: Tokenizer,
    dtype: str,
    draft_length: int | str = "auto",
    max_draft_length: int = 8,
    plan: dict | None = None,
) -> Speculation:
    """The server's speculation: V(k) from the plan's verify times when there is one (and its
    h(k) when the plan measured this very draft), else measured online, as in `generate`."""
    from moespec.decoding.setup import parse_oracle

    speculation = Speculation(draft, target, tokenizer, dtype, draft_length, max_draft_length, plan)
    if draft is None:
        return speculation
    if draft.startswith("oracle"):
        parse_oracle(draft)  # a bad spec fails at start, not on the first request
    elif draft.startswith("suffix"):
        speculation.corpus = suffix_corpus(draft, tokenizer)
    elif speculation.draft_dir is not None:
        speculation.draft_model = load_draft_model(speculation.draft_dir, tokenizer, dtype)
        speculation.draft_byte_ratio = draft_byte_ratio(speculation.draft_model, target)
    return speculation
