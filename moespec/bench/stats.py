"""Summaries shared by the benchmarks."""

import statistics


def ratio_range(ratios) -> dict:
    """Paired per-round ratios as their median and range."""
    ratios = sorted(ratios)
    return {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1]}
