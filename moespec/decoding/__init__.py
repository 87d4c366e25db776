"""Decoding: the generation loop (plain and speculative), sampling, kernel and draft policies."""

from moespec.decoding.draft_policy import DraftLengthPolicy
from moespec.decoding.drafters import (
    Draft,
    Drafter,
    ModelDrafter,
    OracleDrafter,
    PromptLookupDrafter,
    check_same_tokenizer,
)
from moespec.decoding.generate import StepRecord, generate, prefill, summarize
from moespec.decoding.kernel_policy import KernelPolicy
from moespec.decoding.sampling import Sampler
from moespec.decoding.verify import verify

__all__ = [
    "Draft",
    "DraftLengthPolicy",
    "Drafter",
    "KernelPolicy",
    "ModelDrafter",
    "OracleDrafter",
    "PromptLookupDrafter",
    "Sampler",
    "StepRecord",
    "check_same_tokenizer",
    "generate",
    "prefill",
    "summarize",
    "verify",
]
