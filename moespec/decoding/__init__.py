"""Decoding: the generation loop (plain and speculative), sampling, kernel and draft policies."""

from moespec.decoding.generate import StepRecord, generate, prefill, summarize
from moespec.decoding.kernel_policy import KernelPolicy
from moespec.decoding.sampling import Sampler

__all__ = ["KernelPolicy", "Sampler", "StepRecord", "generate", "prefill", "summarize"]
