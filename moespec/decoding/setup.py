"""Building a drafter from a command-line spec: a checkpoint directory, "oracle:A" or "lookup"."""

from collections.abc import Sequence
from pathlib import Path

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
from moespec.models import Tokenizer, Transformer, load_model


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


def parse_oracle(spec: str) -> float:
    text = spec.split(":", 1)[1] if ":" in spec else ""
    try:
        acceptance = float(text)
    except ValueError:
        raise ValueError(
            f"--draft {spec!r}: write oracle:A with A the acceptance, e.g. oracle:0.8"
        ) from None
    if not 0 <= acceptance <= 1:
        raise ValueError(f"--draft {spec!r}: the oracle's acceptance must be in [0, 1]")
    return acceptance


def build_drafter(
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
) -> Drafter:
    """spec: a checkpoint directory, "oracle:A" (greedy only) or "lookup"."""
    vocab = target.config.vocab_size
    if spec == "lookup":
        return PromptLookupDrafter()
    if spec.startswith("oracle"):
        acceptance = parse_oracle(spec)
        if not sampler.greedy:
            raise ValueError("--draft oracle needs greedy decoding (--temperature 0)")
        if reference is None:
            reference = greedy_reference(
                target, prompt, max_tokens, None, target.config.eos_token_ids
            )
        return OracleDrafter(
            reference,
            len(prompt),
            acceptance,
            vocab,
            seed,
            resync=lambda context, n: greedy_reference(target, context, n),
        )
    path = Path(spec)
    if not path.is_dir():
        raise ValueError(f"--draft {spec!r} is neither a checkpoint directory, oracle:A nor lookup")
    draft_model, draft_tokenizer = load_model(path, dtype=dtype)
    check_same_tokenizer(tokenizer, draft_tokenizer, path)
    draft_sampler = Sampler(sampler.temperature, sampler.top_p, seed + 1)
    return ModelDrafter(draft_model, draft_sampler, vocab)
