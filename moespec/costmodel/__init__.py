"""The cost model of speculative decoding on MoE models (seed 000 §3, Appendices B-C).

Pure math: numbers in, numbers out; no torch, no I/O, no globals. Every function accepts floats
and `fractions.Fraction` (exact) inputs, so the paper's theorems can be checked exactly.
"""

from moespec.costmodel.bounds import (
    best_draft_length_is_certain,
    kernel_choice_is_robust,
    saving_bound,
    speedup_bounds,
    speedup_error_factor,
    step_time_error,
    throughput_loss_bound,
    verify_time_bound,
)
from moespec.costmodel.experts import (
    byte_share,
    crossover,
    dedup_expert_bytes,
    dedup_is_faster,
    mean_reuse,
    reuse_threshold,
    reuse_threshold_bytes,
    saving,
    uniform_reuse,
    uniform_union,
    union_from_reuse,
    verify_time,
)
from moespec.costmodel.speculation import (
    best_draft_length,
    convex_reaches,
    crossing_acceptance,
    draft_increments,
    expected_tokens,
    faster_than_plain,
    first_draft_threshold,
    has_convex_increments,
    speedup,
    step_points,
    step_points_convex,
    throughput,
)

__all__ = [
    "best_draft_length",
    "best_draft_length_is_certain",
    "byte_share",
    "convex_reaches",
    "crossing_acceptance",
    "crossover",
    "dedup_expert_bytes",
    "dedup_is_faster",
    "draft_increments",
    "expected_tokens",
    "faster_than_plain",
    "first_draft_threshold",
    "has_convex_increments",
    "kernel_choice_is_robust",
    "mean_reuse",
    "reuse_threshold",
    "reuse_threshold_bytes",
    "saving",
    "saving_bound",
    "speedup",
    "speedup_bounds",
    "speedup_error_factor",
    "step_points",
    "step_points_convex",
    "step_time_error",
    "throughput",
    "throughput_loss_bound",
    "uniform_reuse",
    "uniform_union",
    "union_from_reuse",
    "verify_time",
    "verify_time_bound",
]
