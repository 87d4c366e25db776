"""Building speculation from a command-line spec: "auto" (or "auto:DIR"), a checkpoint
directory, "oracle:A" or "lookup"; the draft-length policy from a plan or measured online."""

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from moespec.decoding.draft_policy import DraftLengthPolicy, RunningMedians
from moespec.decoding.drafters import (
    Drafter,
    ModelDrafter,
    OracleDrafter,
    PromptLookupDrafter,
    check_same_tokenizer,
)
from moespec.decoding.generate import generate
from moespec.decoding.kernel_policy import KernelPolicy
from moespec.decoding.sampling import Sampler
from moespec.decoding.speculation import Option, Speculation
from moespec.decoding.suffix import CorpusIndex, SuffixDrafter
from moespec.errors import SettingError, setting
from moespec.models import Tokenizer, Transformer, load_model
from moespec.models.compiled import capture
from moespec.plan import Plan

SPECS = "auto, auto:DIR, oracle:A, lookup, suffix, suffix:CORPUS, none"


def greedy_reference(
    model: Transformer,
    prompt: Sequence[int],
    max_tokens: int,
    kernels: KernelPolicy | None = None,
    stop_tokens: Sequence[int] = (),
) -> list[int]:
    """The target's plain greedy continuation (what the oracle draft proposes)."""
    records = generate(
        model, prompt, max_tokens=max_tokens, kernels=kernels, stop_tokens=stop_tokens
    )
    return [t for r in records for t in r.tokens]


def runner_up_tokens(
    model: Transformer,
    context: Sequence[int],
    continuation: Sequence[int],
    kernel: str = "dedup",
    chunk: int = 128,
) -> list[int]:
    """For each token of `continuation` after `context`, the target's best next token other
    than it: the arg max of the logits at the position before, or the second-ranked token
    where the arg max is the continuation's own. One teacher-forced pass over both, in
    chunks of `chunk` tokens. What `OracleDrafter(alternatives=...)` proposes for a wrong draft,
    a mistake that routes like text."""
    if not context:
        raise ValueError("runner_up_tokens needs a context of at least one token")
    tokens = list(context) + list(continuation)
    cache = model.new_cache(capacity=len(tokens) + 1)
    picks = []  # top two of the logits predicting tokens[len(context)], ...
    start = 0
    while start < len(tokens) - 1:
        end = min(start + chunk, len(tokens) - 1)
        logits = model(torch.tensor(tokens[start:end]), cache, kernel=kernel, all_logits=True)
        first = max(start, len(context) - 1) - start
        if first < end - start:
            picks += logits[0, first:].float().topk(2, dim=-1).indices.tolist()
        start = end
    return [a if a != token else b for (a, b), token in zip(picks, continuation, strict=True)]


def suffix_corpus(spec: str, tokenizer: Tokenizer) -> CorpusIndex | None:
    """The corpus of "suffix:PATH[:PATH...]" (files or directories) indexed, or None for
    "suffix"; a path that cannot be indexed is a SettingError naming it."""
    paths = [p for p in spec.partition(":")[2].split(os.pathsep) if p]
    if not paths:
        return None
    try:
        return CorpusIndex.from_files(paths, tokenizer)
    except (OSError, ValueError) as error:
        raise SettingError(f"{setting('draft', spec)}: {error}") from None


def parse_oracle(spec: str) -> float:
    text = spec.split(":", 1)[1] if ":" in spec else ""
    try:
        acceptance = float(text)
    except ValueError:
        raise SettingError(
            f"{setting('draft', spec)}: write oracle:A with A the acceptance, e.g. oracle:0.8"
        ) from None
    if not 0 <= acceptance <= 1:
        raise SettingError(f"{setting('draft', spec)}: the oracle's acceptance must be in [0, 1]")
    return acceptance


def load_draft_model(spec: str, tokenizer: Tokenizer, dtype, compile="off") -> Transformer:
    """The draft checkpoint at `spec`, which must share the target's tokenizer; its one-token
    steps compiled by `compile` (moespec.models.compiled.capture)."""
    path = Path(spec)
    if not path.is_dir():
        raise SettingError(
            f"{setting('draft', spec)} is neither a checkpoint directory nor one of {SPECS}"
        )
    draft_model, draft_tokenizer = load_model(path, dtype=dtype)
    check_same_tokenizer(tokenizer, draft_tokenizer, path)
    capture(draft_model, compile)
    return draft_model


def drafter_factory(
    spec: str,
    *,
    target: Transformer,
    tokenizer: Tokenizer,
    sampler: Sampler,
    prompt: Sequence[int],
    max_tokens: int,
    dtype,
    reference: list[int] | None = None,
    seed: int = 0,
    compile: str = "off",
) -> Callable[[], Drafter]:
    """A function giving a fresh drafter of `spec` (a checkpoint directory, "oracle:A" for
    greedy decoding only, or "lookup") per generation; checkpoints and the oracle's reference
    are made once; a checkpoint's one-token steps compiled by `compile` (its factory's
    `model` attribute is the draft model)."""
    vocab = target.config.vocab_size
    if spec == "lookup":
        return PromptLookupDrafter
    if spec == "suffix" or spec.startswith("suffix:"):
        corpus = suffix_corpus(spec, tokenizer)

        def make_suffix() -> Drafter:
            return SuffixDrafter(corpus)

        make_suffix.note = corpus.note if corpus is not None else None
        return make_suffix
    if spec.startswith("oracle"):
        acceptance = parse_oracle(spec)
        if not sampler.greedy:
            raise SettingError(
                f"{setting('draft', 'oracle')} needs greedy decoding ({setting('temperature', 0)})"
            )
        if reference is None:
            reference = greedy_reference(
                target, prompt, max_tokens, None, target.config.eos_token_ids
            )
        return lambda: OracleDrafter(
            reference,
            len(prompt),
            acceptance,
            vocab,
            seed,
            resync=lambda context, n: greedy_reference(target, context, n),
        )
    draft_model = load_draft_model(spec, tokenizer, dtype, compile)

    def make() -> Drafter:
        return ModelDrafter(
            draft_model, Sampler(sampler.temperature, sampler.top_p, seed + 1), vocab
        )

    make.model = draft_model
    return make


def build_drafter(spec: str, **settings) -> Drafter:
    """One drafter of `spec` (see `drafter_factory` for the settings)."""
    return drafter_factory(spec, **settings)()


def speculation_factory(
    spec: str,
    *,
    draft_length: int | str = "auto",
    max_draft_length: int = 8,
    plan: Plan | None = None,
    **settings,
) -> Callable[[], Speculation]:
    """A function giving fresh speculation state (drafter caches, estimates, step times) per
    generation: what `--draft SPEC` decodes with.

    spec: "auto" chooses per step between the suffix drafter and none;
    "auto:DIR" adds the draft model DIR; anything else is that drafter alone
    (`drafter_factory`, whose settings the others are). plan: a plan (`moespec plan`) whose
    verify times give every drafter's tau(n), and whose draft times give h(k) of the draft it
    measured (`plan.draft_dir`).
    """
    if spec == "auto" or spec.startswith("auto:"):
        model_dir = spec.partition(":")[2] or None
        # prompt lookup is not among them: the suffix drafter's matches of 1-3 tokens are
        # lookup's, and its longer ones and counts are more (see `moespec.decoding.suffix`);
        # proposing twice cost a choice a quarter more
        specs = {"suffix": "suffix", **({"model": model_dir} if model_dir else {})}
    else:
        specs = {None: spec}
    makers = {name: drafter_factory(s, **settings) for name, s in specs.items()}
    ratios = {  # the draft models' h(k) before it is measured
        name: draft_byte_ratio(maker.model, settings["target"])
        for name, maker in makers.items()
        if hasattr(maker, "model")
    }

    def make() -> Speculation:
        shared = RunningMedians()
        options = {}
        for name, maker in makers.items():
            drafter = maker()
            draft_dir = specs[name] if isinstance(drafter, ModelDrafter) else None
            policy = draft_length_policy(draft_length, max_draft_length, plan, draft_dir, shared)
            policy.draft_byte_ratio = ratios.get(name)
            options[drafter.name] = Option(drafter, policy)
        return Speculation(options)

    make.models = {name or "model": m.model for name, m in makers.items() if hasattr(m, "model")}
    make.notes = [m.note for m in makers.values() if getattr(m, "note", None)]
    return make


def draft_byte_ratio(draft_model: Transformer, target: Transformer) -> float:
    """The draft's weight bytes per token over the target's: its h(k) before it is measured
    is k steps of this share of tau(1) (`DraftLengthPolicy.draft_byte_ratio`)."""
    return draft_model.step_bytes() / target.step_bytes()


def draft_length_policy(
    draft_length, max_draft_length, plan=None, draft_dir=None, measured_verify=None
) -> DraftLengthPolicy:
    """The draft-length policy: V(k) from the plan's verify times (and its draft's h(k) when
    the plan measured this very draft), else measured online."""
    if plan is None:
        return DraftLengthPolicy(
            draft_length, max_draft_length=max_draft_length, measured_verify=measured_verify
        )
    return plan.draft_policy(draft_dir, draft_length, max_draft_length, measured_verify)


def draft_name(spec: str | None) -> str | None:
    """The draft as results name it: checkpoints as `describe` names them."""
    from moespec.demo import describe

    if spec is None or spec in ("auto", "lookup") or spec.startswith("oracle"):
        return spec
    if spec.startswith("auto:"):
        return f"auto:{describe(spec[5:])}"
    return describe(spec)
