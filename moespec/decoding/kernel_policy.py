"""Which expert kernel runs a pass of n tokens: fixed, switched at a crossover, or measured.

"auto" with a crossover (from a plan or a flag): per-slot below it, deduplicating from it
(seed 000 §4). "auto" without one: the engine measures both kernels at each pass size it
runs (a few passes each, alternating), then runs the one with the lower running median —
the crossover found online, from the same step times the draft-length policy reads.
"""

import statistics
from collections import defaultdict, deque

from moespec.kernels import KERNELS

CHOICES = (*KERNELS, "auto")


class KernelPolicy:
    """kernel: a kernel name or "auto"; crossover: the pass size deduplication starts at.

    explore: passes of each kernel measured at a pass size before choosing; window: samples
    kept per (kernel, pass size).
    """

    def __init__(
        self,
        kernel: str = "auto",
        crossover: int | None = None,
        *,
        explore: int = 3,
        window: int = 16,
    ):
        if kernel not in CHOICES:
            raise ValueError(f"unknown kernel {kernel!r}; choose one of {', '.join(CHOICES)}")
        if crossover is not None and crossover < 1:
            raise ValueError(f"crossover must be a pass size >= 1, got {crossover}")
        self.kernel, self.crossover, self.explore = kernel, crossover, explore
        self.times = defaultdict(lambda: deque(maxlen=window))

    @property
    def online(self) -> bool:
        return self.kernel == "auto" and self.crossover is None

    def for_pass(self, n_tokens: int) -> str:
        """The kernel of a verification (or decode) pass of n tokens."""
        if self.kernel != "auto":
            return self.kernel
        if n_tokens == 1:
            return "slot"  # one token: both kernels read the same experts once
        if self.crossover is not None:
            return "dedup" if n_tokens >= self.crossover else "slot"
        slot, dedup = self.times["slot", n_tokens], self.times["dedup", n_tokens]
        if min(len(slot), len(dedup)) < self.explore:
            return "slot" if len(slot) <= len(dedup) else "dedup"
        return "dedup" if statistics.median(dedup) < statistics.median(slot) else "slot"

    def observe(self, n_tokens: int, kernel: str, seconds: float) -> None:
        """Record a pass's time (used only when choosing online)."""
        if self.online and n_tokens > 1:
            self.times[kernel, n_tokens].append(seconds)

    def measured_crossover(self) -> int | None:
        """The smallest measured pass size from which deduplication stays faster."""
        from moespec.costmodel import crossover

        sizes = sorted({n for _, n in self.times})
        savings = {
            n: statistics.median(self.times["slot", n]) - statistics.median(self.times["dedup", n])
            for n in sizes
            if self.times["slot", n] and self.times["dedup", n]
        }
        return crossover(savings) if savings else None

    def for_prefill(self) -> str:
        """Prompt passes are long: a per-slot loop over hundreds of tokens would be pointless."""
        return self.kernel if self.kernel in ("reference", "dedup", "dedup-linear") else "dedup"
