"""What each request drafts with: the drafter and the draft-length policy, built as
`moespec generate` builds them (moespec.decoding.setup.build_drafter, DraftLengthPolicy).

The server builds one `Speculation` at start: the draft-length policy is shared by every
request, so the step times V(k) it measures (hardware facts) carry over from request to
request while its acceptance estimate forgets old steps; a draft checkpoint is loaded once and
each request gets a drafter of its own (its own cache, its own seeded sampler).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from moespec.decoding import Drafter, DraftLengthPolicy, ModelDrafter, Sampler
from moespec.decoding.setup import build_drafter, parse_oracle
from moespec.models import Tokenizer, Transformer


@dataclass
class Speculation:
    """draft: the drafter spec (a checkpoint directory, "oracle:A", "lookup") or None (plain
    decoding); policy: the shared draft-length policy; draft_model: a loaded draft checkpoint."""

    draft: str | None
    target: Transformer
    tokenizer: Tokenizer
    dtype: str
    policy: DraftLengthPolicy | None
    draft_model: Transformer | None = None

    @property
    def name(self) -> str:
        """The draft as results name it ("moespec/demo/draft" for the demo's), or "none"."""
        from moespec.demo import describe

        return "none" if self.draft is None else describe(self.draft)

    def check(self, sampler: Sampler) -> None:
        """Refuse a request this speculation cannot serve (before it is queued)."""
        if self.draft is not None and self.draft.startswith("oracle") and not sampler.greedy:
            raise ValueError("this server drafts with the oracle, which needs temperature 0")

    def drafter(
        self, sampler: Sampler, prompt: Sequence[int], max_tokens: int, seed: int
    ) -> Drafter | None:
        """A fresh drafter for one request (None without a draft)."""
        if self.draft is None:
            return None
        if self.draft_model is not None:
            draft_sampler = Sampler(sampler.temperature, sampler.top_p, seed + 1)
            return ModelDrafter(self.draft_model, draft_sampler, self.target.config.vocab_size)
        return build_drafter(
            self.draft,
            target=self.target,
            tokenizer=self.tokenizer,
            sampler=sampler,
            prompt=prompt,
            max_tokens=max_tokens,
            dtype=self.dtype,
            seed=seed,
        )


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
    if draft is None:
        return Speculation(None, target, tokenizer, dtype, None)
    draft_model = None
    if Path(draft).is_dir():
        from moespec.decoding import check_same_tokenizer
        from moespec.models import load_model

        draft_model, draft_tokenizer = load_model(draft, dtype=dtype)
        check_same_tokenizer(tokenizer, draft_tokenizer, draft)
    elif draft.startswith("oracle"):
        parse_oracle(draft)  # a bad spec fails at start, not on the first request
    elif draft != "lookup":
        raise ValueError(
            f"--draft {draft!r} is neither a checkpoint directory, oracle:A nor lookup"
        )
    return Speculation(
        draft,
        target,
        tokenizer,
        dtype,
        draft_policy(draft, draft_length, max_draft_length, plan),
        draft_model,
    )


def draft_policy(draft, draft_length, max_draft_length, plan) -> DraftLengthPolicy:
    if plan is None:
        return DraftLengthPolicy(draft_length, max_draft_length=max_draft_length)
    from moespec.demo import describe

    planned = plan.get("draft_dir")
    same_draft = planned is not None and (
        describe(draft) == planned or Path(draft).resolve() == Path(planned).resolve()
    )
    return DraftLengthPolicy(
        draft_length,
        max_draft_length=max_draft_length,
        verify_times=plan["verify_time"],
        draft_times=plan["draft_time"] if same_draft else None,
    )
