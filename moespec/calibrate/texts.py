"""The texts calibration measures on: held-out standard-library files of the embedded corpus
(never trained on by the demo models), split by document into a fit part (the routing trace
that U(n) and the benchmark windows come from) and a test part (whole-model passes), so the two
never share a document (`moespec.routing.reuse.document_part`)."""

import itertools

# Routing a plan records on the embedded corpus: its documents' first TRACE_TOKENS / 24 tokens
# each. At full size recording is a forward pass per token, the plan's largest stage; what the
# plan reads of it (U(n), rho, windows of up to 9 tokens, B windows of B documents) needs
# documents, not long ones.
TRACE_TOKENS = 8192

# Whole-model verify rounds a plan times (`calibrate.verify.measure_verify`): up to
# VERIFY_REPEATS after one warm-up round (routing has just run every layer), fewer once the
# stage has run VERIFY_SECONDS with VERIFY_MIN_REPEATS timed. A round of OLMoE-1B-7B's 18
# cells takes ~35 s on 2 cores (the whole plan took 13 min at 10 rounds); the demo's, well
# under a second.
VERIFY_REPEATS = 10
VERIFY_MIN_REPEATS = 5
VERIFY_SECONDS = 200.0
VERIFY_WARMUP = 1

# What whole-model verify passes run on (`verify_tokens`, for `plan` and `measure-verify`):
# the target's greedy continuation of a fit document's first CONTINUATION_PROMPT tokens (the
# kind of text decoding verifies), or the test documents one after another.
VERIFY_TEXTS = ("continuations", "documents")
CONTINUATION_PROMPT = 64


def stdlib_documents(count: int = 24, max_chars: int = 6000):
    """The embedded corpus for measuring: held-out standard-library files, at most `count` of
    them, each cut to `max_chars` characters."""
    from moespec.demo.corpus import held_out_documents

    return held_out_documents(count, max_chars)


def verify_documents(count: int = 4, max_chars: int = 20000):
    """Held-out files of the test part for whole-model verify times: never in the fit part
    that U(n) and the benchmark windows come from."""
    from moespec.demo.corpus import held_out_documents
    from moespec.routing.reuse import document_part

    documents = (
        d for d in held_out_documents(max_chars=max_chars) if document_part(d.name) == "test"
    )
    return list(itertools.islice(documents, count))


def fit_documents(count: int, max_chars: int = 20000):
    """Held-out files of the fit part (those U(n) and the benchmark windows come from): never
    in the test part that evaluations score on."""
    from moespec.demo.corpus import held_out_documents
    from moespec.routing.reuse import document_part

    documents = (
        d for d in held_out_documents(max_chars=max_chars) if document_part(d.name) == "fit"
    )
    return list(itertools.islice(documents, count))


def verify_text(tokenizer) -> list[int]:
    """Tokens of the test documents, one after another, for whole-model passes."""
    from moespec.routing.record import tokenize_documents

    return [t for _, ids in tokenize_documents(tokenizer, verify_documents()) for t in ids]


def fit_continuations(model, tokenizer, count: int, prompt_tokens: int, tokens: int):
    """`count` streams: the first `prompt_tokens` tokens of a fit document, then the target's
    greedy continuation of `tokens` tokens (the kind of text decoding verifies, from documents
    the evaluation never scores on)."""
    from moespec.decoding.setup import greedy_reference
    from moespec.routing.record import tokenize_documents

    documents = tokenize_documents(tokenizer, fit_documents(count * 2))
    prompts = [ids[:prompt_tokens] for _, ids in documents if len(ids) >= prompt_tokens][:count]
    if not prompts:
        raise ValueError(f"no fit document gives a prompt of {prompt_tokens} tokens")
    return [p + greedy_reference(model, p, tokens) for p in prompts]


def check_verify_text(kind: str) -> None:
    """Refuse a verify text that is not one of VERIFY_TEXTS (a SettingError naming it)."""
    from moespec.errors import SettingError, setting

    if kind not in VERIFY_TEXTS:
        raise SettingError(
            f"{setting('verify_text', kind)} is not a verify text: expected one of "
            f"{', '.join(VERIFY_TEXTS)}"
        )


def verify_tokens(model, tokenizer, kind: str, first: int, end: int, progress) -> list[int]:
    """The tokens whole-model verify passes run on, the positions [first, end) timed (the
    caller's `calibrate.verify.pass_span`). "continuations": the first CONTINUATION_PROMPT
    tokens of a fit document (fewer where `first` comes sooner), then the target's greedy
    continuation up to `end`, so every timed pass verifies text of the kind decoding verifies
    (what an evaluation's in-process calibration times by default; on the demo target, in one
    process, its verify-time error was 3.3% / 11.5% against 24-31% on the documents). The
    prompt is a fit document's start, never a test document that evaluations score on; its
    length is checked against the context before any of it is decoded. "documents": the test
    documents one after another (plans before this reading)."""
    from moespec.errors import setting
    from moespec.models.context import fit_context

    check_verify_text(kind)
    if kind == "documents":
        return verify_text(tokenizer)
    fit_context(range(end), model.config, what=f"a pass ending at token {end}",
                fix=f"lower {setting('depth')}")  # fmt: skip
    prompt = min(CONTINUATION_PROMPT, max(1, first))
    progress.start(f"decoding the verify text: {end - prompt} greedy tokens after {prompt}")
    return fit_continuations(model, tokenizer, 1, prompt, end - prompt)[0]
