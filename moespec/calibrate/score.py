"""Scoring a plan against whole-model runs it never saw: the six rules of seed 000 Table 8.

Written before the runs it scores; each rule returns (holds, detail). Inputs: the plan's
predicted verify times (per kernel, n = 1..n_max) and step times V_hat(k); a fresh
measure-verify run (every sample, per kernel and n); an oracle sweep (tokens/s per
acceptance and draft length).

The thresholds are Table 8's, as written there, and tests pin each of them: a crossover
within one (a measured crossover at n_max counts as within one of none, and only that way
round); k_hat* within one of the measured best at >= 9 of 11 acceptances; at most 6% of the
best throughput lost by drafting k_hat*, at every acceptance; the sign of S(n) right wherever
its 95% interval excludes 0; verify time within 15% for both kernels at n >= 2; the measured
best speedup inside bound (21), which needs delta < 1 (at delta >= 1 the rule fails).
"""

import numpy as np

from moespec.costmodel import best_draft_length, crossover, speedup
from moespec.plan import Plan

CROSSOVER_WITHIN = 1
BEST_DRAFT_WITHIN = 1
BEST_DRAFT_REQUIRED = 9  # acceptances of the 11 of Table 8
MAX_THROUGHPUT_LOSS = 0.06
SAVING_INTERVAL = 0.95
VERIFY_TOLERANCE = 0.15


def measured_crossover(slot: list[float], dedup: list[float]) -> int | None:
    """The smallest n >= 2 from which the measured saving's point estimate stays positive."""
    return crossover(
        {n: s - d for n, (s, d) in enumerate(zip(slot, dedup, strict=True), 1) if n >= 2}
    )


def rule_crossover(predicted: int | None, measured: int | None, max_n: int) -> tuple[bool, str]:
    """Within one; a measured crossover at n_max counts as within one of a predicted none
    (Table 8), not the other way round."""
    detail = f"{predicted} / {measured}"
    if predicted is None:
        return measured is None or measured == max_n, detail
    if measured is None:
        return False, detail
    return abs(predicted - measured) <= CROSSOVER_WITHIN, detail


def saving_interval(slot_samples, dedup_samples, resamples: int = 2000, seed: int = 0):
    """95% bootstrap interval of median(slot) - median(dedup)."""
    rng = np.random.default_rng(seed)
    slot, dedup = np.asarray(slot_samples), np.asarray(dedup_samples)
    draws = [
        np.median(rng.choice(slot, len(slot))) - np.median(rng.choice(dedup, len(dedup)))
        for _ in range(resamples)
    ]
    tail = 100 * (1 - SAVING_INTERVAL) / 2
    return float(np.percentile(draws, tail)), float(np.percentile(draws, 100 - tail))


def rule_sign(predicted_saving, samples: dict, dedup_kernel: str) -> tuple[bool, str]:
    """The predicted sign of S(n) is right wherever the measured interval excludes 0."""
    checked = right = 0
    for n in range(2, len(predicted_saving) + 1):
        low, high = saving_interval(samples[("slot", n)], samples[(dedup_kernel, n)], seed=n)
        if low > 0 or high < 0:
            checked += 1
            right += (predicted_saving[n - 1] > 0) == (low > 0)
    return right == checked, f"{right} of {checked}"


def rule_verify_time(predicted: dict, measured: dict, tolerance: float = VERIFY_TOLERANCE):
    """Verify time within 15% for both kernels at n = 2..n_max."""
    worst = max(
        abs(p - m) / m
        for kernel in measured
        for n, (p, m) in enumerate(zip(predicted[kernel], measured[kernel], strict=True), 1)
        if n >= 2
    )
    return worst <= tolerance, f"{worst:.1%}"


def rule_best_draft_length(step_times, sweep: dict, required: int = BEST_DRAFT_REQUIRED):
    """k_hat* within one of the measured best at >= 9 of 11 acceptances, and the throughput
    lost by drafting k_hat* at most 6% at every acceptance. Returns both rules."""
    within, worst_loss = 0, 0.0
    for a, row in sweep.items():
        rates = {int(k): v for k, v in row["tokens_per_second"].items()}
        best = max(rates, key=lambda k: (rates[k], -k))
        k_hat = best_draft_length(step_times, float(a))
        within += abs(k_hat - best) <= BEST_DRAFT_WITHIN
        worst_loss = max(worst_loss, 1 - rates[k_hat] / rates[best])
    return (
        (within >= required, f"{within} of {len(sweep)}"),
        (worst_loss <= MAX_THROUGHPUT_LOSS, f"{worst_loss:.1%}"),
    )


def rule_speedup(step_times, sweep: dict, delta: float):
    """The measured best speedup lies inside bound (21) around the predicted best speedup;
    (21) needs delta < 1, so at delta >= 1 the rule fails."""
    if not delta < 1:
        return False, f"delta = {delta:.3f} >= 1: bound (21) is undefined"
    low, high = (1 - delta) / (1 + delta), (1 + delta) / (1 - delta)
    inside = 0
    for a, row in sweep.items():
        rates = {int(k): v for k, v in row["tokens_per_second"].items()}
        measured = max(rates.values()) / rates[0]
        k_hat = best_draft_length(step_times, float(a))
        predicted = float(speedup(step_times, float(a), k_hat))
        inside += low <= predicted / measured <= high
    return inside == len(sweep), f"{inside} of {len(sweep)} (delta = {delta:.3f})"


def step_time_error_of(predicted_steps, measured_steps) -> float:
    """delta: the largest relative error of the predicted step times."""
    return max(abs(p - m) / m for p, m in zip(predicted_steps, measured_steps, strict=True))


def score(plan: Plan, verify_records: list[dict], sweep: dict, version: str = "calibrated"):
    """{rule: (holds, detail)} for one prediction version of a plan."""
    prediction = plan.predictions[version]
    return score_values(
        crossover=prediction.crossover,
        saving=prediction.saving,
        verify_time=prediction.verify_time,
        step_times=prediction.staircase.step_times,
        draft_time=plan.draft_time,
        dedup_kernel=plan.kernel.dedup_kernel,
        verify_records=verify_records,
        sweep=sweep,
    )


def score_prediction(prediction, verify_records: list[dict], sweep: dict, step_kernel="auto"):
    """{rule: (holds, detail)} for a `Prediction` (moespec.calibrate.predict)."""
    return score_values(
        crossover=prediction.crossover(),
        saving=list(prediction.saving()),
        verify_time={k: list(v) for k, v in prediction.verify.items()},
        step_times=prediction.step_times(),
        draft_time=list(prediction.draft_time),
        dedup_kernel=prediction.dedup_kernel,
        verify_records=verify_records,
        sweep=sweep,
        step_kernel=step_kernel,
    )


def score_values(
    *,
    crossover,
    saving,
    verify_time: dict,
    step_times,
    draft_time,
    dedup_kernel: str,
    verify_records: list[dict],
    sweep: dict,
    step_kernel: str = "auto",
):
    """The six rules from a prediction's values. step_kernel: the kernel of the measured step
    time V(k) that delta compares with ("auto": the measured crossover's; seed 000 uses the
    deduplicating kernel's), the per-slot kernel at n = 1 either way."""
    max_n = len(saving)
    samples = {(r["kernel"], r["n_tokens"]): r["seconds"] for r in verify_records}
    measured = {
        k: [float(np.median(samples[(k, n)])) for n in range(1, max_n + 1)]
        for k in ("slot", dedup_kernel)
    }
    measured_cross = measured_crossover(measured["slot"], measured[dedup_kernel])

    def measured_kernel(n: int) -> str:
        if n == 1:
            return "slot"
        if step_kernel != "auto":
            return step_kernel
        return dedup_kernel if measured_cross and n >= measured_cross else "slot"

    measured_steps = [
        measured[measured_kernel(n)][n - 1] + draft_time[n - 1] for n in range(1, max_n + 1)
    ]
    if all(v > 0 for v in step_times):
        k_rule, loss_rule = rule_best_draft_length(step_times, sweep["by_acceptance"])
        delta = step_time_error_of(step_times, measured_steps)
        speedup_rule = rule_speedup(step_times, sweep["by_acceptance"], delta)
    else:  # fits extrapolating noise: no staircase to score, the three rules fail
        k_rule = loss_rule = speedup_rule = (False, "a predicted step time is not positive")
    return {
        "crossover within one": rule_crossover(crossover, measured_cross, max_n),
        "k* within one at >= 9 of 11": k_rule,
        "throughput lost <= 6%": loss_rule,
        "sign of S(n)": rule_sign(saving, samples, dedup_kernel),
        "verify time within 15%": rule_verify_time(verify_time, measured),
        "best speedup inside (21)": speedup_rule,
    }


def noise_floor(sweep: dict) -> dict:
    """The k* and loss rules with k* taken from the sweep's own measured V(k) (its steps as
    tokens/s pays them): what the sweep's noise alone lets a perfect prediction reach
    (reported beside every score)."""
    k_rule, loss_rule = rule_best_draft_length(sweep["step_times"], sweep["by_acceptance"])
    return {"k* within one at >= 9 of 11": k_rule, "throughput lost <= 6%": loss_rule}
