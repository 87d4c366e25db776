"""Speculative against plain decoding, measured like with like.

Both arms are warmed up the same way (one short untimed generation each), then run in rounds
whose order alternates (speculative first, then plain first, ...), each generation from fresh
state, so drift and warm-up fall on both alike. A round's ratio is its speculative tokens/s
over its plain tokens/s; the comparison reports their median and range. Decode throughput is
prefill-free (`summarize`), and the time a consumer spends between steps is not counted.
"""

import statistics
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

from moespec.decoding.generate import StepRecord, summarize

Arm = Callable[[int], Iterator[StepRecord]]  # max_tokens -> a fresh generation's records


@dataclass
class Round:
    plain_first: bool
    plain_tokens_per_second: float
    tokens_per_second: float
    same_tokens: bool

    @property
    def ratio(self) -> float:
        return self.tokens_per_second / self.plain_tokens_per_second


@dataclass
class Comparison:
    rounds: list[Round]

    @property
    def ratios(self) -> list[float]:
        return [r.ratio for r in self.rounds]

    @property
    def speedup(self) -> float:
        """Median of the paired rounds' ratios."""
        return statistics.median(self.ratios)

    @property
    def same_tokens(self) -> bool:
        return all(r.same_tokens for r in self.rounds)

    def to_dict(self) -> dict:
        return {
            "speedup": self.speedup,
            "speedup_range": [min(self.ratios), max(self.ratios)],
            "plain_tokens_per_second": statistics.median(
                r.plain_tokens_per_second for r in self.rounds
            ),
            "tokens_per_second": statistics.median(r.tokens_per_second for r in self.rounds),
            "same_tokens_as_plain": self.same_tokens,
            "rounds": [{**asdict(r), "ratio": r.ratio} for r in self.rounds],
        }


def compare_plain(
    speculative: Arm,
    plain: Arm,
    max_tokens: int,
    *,
    rounds: int = 3,
    warm_up_tokens: int = 16,
    on_speculative: Callable[[StepRecord], None] | None = None,
) -> tuple[Comparison, list[StepRecord]]:
    """Run `rounds` paired rounds; return the comparison and the first speculative
    generation's records (whose steps `on_speculative` receives as they come)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    for arm in (plain, speculative):
        for _ in arm(min(warm_up_tokens, max_tokens)):
            pass
    results, shown = [], None
    for i in range(rounds):
        plain_first = i % 2 == 1
        runs = {}
        for name in ("plain", "speculative") if plain_first else ("speculative", "plain"):
            arm = plain if name == "plain" else speculative
            records = []
            for record in arm(max_tokens):
                records.append(record)
                if name == "speculative" and shown is None and on_speculative is not None:
                    on_speculative(record)
            runs[name] = records
        shown = shown or runs["speculative"]
        tokens = {name: [t for r in recs for t in r.tokens] for name, recs in runs.items()}
        rates = {name: summarize(recs)["tokens_per_second"] for name, recs in runs.items()}
        if not rates["plain"] or not rates["speculative"]:
            raise ValueError(
                f"max_tokens={max_tokens} leaves no decode step to time; ask for at least 2"
            )
        results.append(
            Round(
                plain_first,
                rates["plain"],
                rates["speculative"],
                tokens["plain"] == tokens["speculative"],
            )
        )
    return Comparison(results), shown
