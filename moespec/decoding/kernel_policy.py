"""Which expert kernel runs a pass of n tokens: fixed, or switched at a crossover pass size."""

from dataclasses import dataclass

from moespec.kernels import KERNELS

CHOICES = (*KERNELS, "auto")


@dataclass(frozen=True)
class KernelPolicy:
    """kernel: a kernel name, or "auto": per-slot below `crossover`, deduplicating from it
    (seed 000 §4: deduplication pays from the crossover pass size on; None: never)."""

    kernel: str = "auto"
    crossover: int | None = None

    def __post_init__(self):
        if self.kernel not in CHOICES:
            raise ValueError(f"unknown kernel {self.kernel!r}; choose one of {', '.join(CHOICES)}")
        if self.crossover is not None and self.crossover < 1:
            raise ValueError(f"crossover must be a pass size >= 1, got {self.crossover}")

    def for_pass(self, n_tokens: int) -> str:
        """The kernel of a verification (or decode) pass of n tokens."""
        if self.kernel != "auto":
            return self.kernel
        if self.crossover is not None and n_tokens >= max(self.crossover, 2):
            return "dedup"
        return "slot"

    def for_prefill(self) -> str:
        """Prompt passes are long: a per-slot loop over hundreds of tokens would be pointless."""
        return self.kernel if self.kernel in ("reference", "dedup", "dedup-linear") else "dedup"
