"""The prediction chain (seed 000 §4, eq. 22): whole-model decisions from bytes over bandwidth.

    tau_hat_p(n) = tau_meas(1) + sum_l ( t_p,l(n) - t_l(1) )

t_p,l(n) is layer l's expert-operation time with kernel p, averaged over windows of recorded
routing: from the fits at each layer's mean union U_l(n) (the *prediction*; the fits are linear
in U, so the mean over windows is the fit at the mean), or the measured medians on the
benchmarked windows (the *measured-time version*). t_l(1) is the per-slot one-token time (the
engine runs the per-slot kernel at n = 1 whatever the switch). The *calibrated version* adds
g(n), the growth with n of the time outside the expert operation, measured on whole-model
passes with deduplication off. From tau_hat follow S(n), the crossover, V_hat(k), k*(a), the
speedup and the error bounds (17)-(21).
"""

from dataclasses import dataclass, field, replace

import numpy as np

from moespec.costmodel import (
    best_draft_length,
    best_draft_length_is_certain,
    crossover,
    kernel_choice_is_robust,
    saving_bound,
    speedup,
    speedup_bounds,
    step_points,
    step_time_error,
    throughput_loss_bound,
)

ACCEPTANCES = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98)

LayerTimes = dict[str, np.ndarray]  # kernel -> [L, n_max]: t_p,l(n) at n = index + 1


def times_from_fits(fits: dict, unions: np.ndarray, expert_bytes, top_k: int) -> LayerTimes:
    """t_p,l(n) = fit_p(n, U_l(n), w_l); unions: [L, n_max] with U_l(n) at column n - 1."""
    layers, max_n = unions.shape
    return {
        kernel: np.array(
            [
                [fit.predict(n, unions[l, n - 1], expert_bytes[l]) for n in range(1, max_n + 1)]
                for l in range(layers)
            ]
        )
        for kernel, fit in fits.items()
    }


def times_from_layer_fits(
    layer_fits, layer_indices: list[int], unions: np.ndarray, expert_bytes
) -> LayerTimes:
    """t_p,l(n) from each layer's own fit (seed 000 fits per layer), the pooled fit for a
    layer that was not benchmarked; unions: [L, n_max], rows in `layer_indices` order."""
    max_n = unions.shape[1]
    kernels = list(layer_fits.pooled)
    return {
        kernel: np.array(
            [
                [
                    layer_fits.for_layer(layer)[kernel].predict(
                        n, unions[row, n - 1], expert_bytes[row]
                    )
                    for n in range(1, max_n + 1)
                ]
                for row, layer in enumerate(layer_indices)
            ]
        )
        for kernel in kernels
    }


def times_from_measurements(
    records: list[dict], layer_indices: list[int], max_n: int
) -> LayerTimes:
    """t_p,l(n): the mean of the measured medians on layer l's recorded windows. Layers not
    benchmarked take the mean over benchmarked layers (same expert shapes, other routing)."""
    sums: dict[tuple[str, int, int], list[float]] = {}
    for r in records:
        if r["design"] == "window":
            sums.setdefault((r["kernel"], r["layer"], r["n_tokens"]), []).append(r["median"])
    kernels = sorted({k for k, _, _ in sums})
    out = {}
    for kernel in kernels:
        table = np.full((len(layer_indices), max_n), np.nan)
        for row, layer in enumerate(layer_indices):
            for n in range(1, max_n + 1):
                values = sums.get((kernel, layer, n))
                if values:
                    table[row, n - 1] = np.mean(values)
        missing = np.isnan(table)
        if missing.all(axis=0).any():
            absent = [n + 1 for n in np.flatnonzero(missing.all(axis=0))]
            raise ValueError(f"no recorded window of n = {absent} was measured for {kernel}")
        fill = np.nanmean(table, axis=0)
        out[kernel] = np.where(missing, fill[None, :], table)
    return out


def verify_times(
    plain_time: float, layer_times: LayerTimes, outside_growth: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """Eq. (22): tau_hat_p(n) for n = 1..n_max, per kernel (+ g(n) when calibrated)."""
    one_token = layer_times["slot"][:, 0]  # t_l(1), per-slot at n = 1
    out = {}
    for kernel, table in layer_times.items():
        tau = plain_time + (table - one_token[:, None]).sum(axis=0)
        tau[0] = plain_time  # a one-token pass runs the same kernel either way
        if outside_growth is not None:
            tau = tau + outside_growth
        out[kernel] = tau
    return out


def outside_growth(measured_slot: np.ndarray, layer_times: LayerTimes) -> np.ndarray:
    """g(n): the growth with n of the whole-model time outside the expert operation, from
    whole-model passes with the per-slot kernel (deduplication off)."""
    outside = measured_slot - layer_times["slot"].sum(axis=0)
    return outside - outside[0]


@dataclass
class Prediction:
    """Everything the chain predicts from verify times tau_hat_p(n), n = 1..n_max."""

    verify: dict[str, np.ndarray]  # kernel -> [n_max]
    expert_time: dict[str, np.ndarray]  # kernel -> M_hat^e_p(n) = sum_l t_p,l(n)
    bandwidth_error: float  # epsilon
    draft_time: np.ndarray  # h(k), k = 0..n_max-1
    dedup_kernel: str = "dedup"
    acceptances: tuple = ACCEPTANCES
    details: dict = field(default_factory=dict)
    # The verify time in V_hat(k): "auto" (the kernel the plan's crossover picks, what the
    # engine runs) or a kernel name; seed 000 scores V_hat(k) = tau_hat_dedup(k + 1) + h(k).
    step_kernel: str = "auto"

    @property
    def max_n(self) -> int:
        return len(self.verify["slot"])

    def saving(self) -> np.ndarray:
        """S(n) = tau_slot(n) - tau_dedup(n), eq. (6)."""
        return self.verify["slot"] - self.verify[self.dedup_kernel]

    def crossover(self) -> int | None:
        """The smallest n from which deduplication stays faster (n = 2..n_max)."""
        return crossover({n: s for n, s in enumerate(self.saving(), start=1) if n >= 2})

    def saving_bound(self) -> np.ndarray | None:
        """(18): eps/(1-eps) (M^e_slot + M^e_dedup) per n (None when eps >= 1).

        A fit may extrapolate a small pass to a negative time; such a time counts as 0."""
        if not 0 <= self.bandwidth_error < 1:
            return None
        return np.array(
            [
                saving_bound(max(float(a), 0.0), max(float(b), 0.0), self.bandwidth_error)
                for a, b in zip(
                    self.expert_time["slot"], self.expert_time[self.dedup_kernel], strict=True
                )
            ]
        )

    def kernel_for(self, n_tokens: int) -> str:
        c = self.crossover()
        return self.dedup_kernel if c is not None and n_tokens >= c else "slot"

    def auto_verify(self) -> np.ndarray:
        """tau of the pass size's chosen kernel: what the engine runs with this plan."""
        return np.array([self.verify[self.kernel_for(n)][n - 1] for n in range(1, self.max_n + 1)])

    def step_verify(self) -> np.ndarray:
        """tau_hat(n) of the step kernel; a one-token pass runs the per-slot kernel."""
        if self.step_kernel == "auto":
            return self.auto_verify()
        tau = self.verify[self.step_kernel].copy()
        tau[0] = self.verify["slot"][0]
        return tau

    def step_times(self) -> list[float]:
        """V_hat(k) = tau_hat(k + 1) + h(k), k = 0..n_max - 1."""
        return [float(t + h) for t, h in zip(self.step_verify(), self.draft_time, strict=True)]

    def valid(self) -> bool:
        """Every predicted step time is positive (fits extrapolating noise can break this)."""
        return all(v > 0 for v in self.step_times())

    def staircase(self) -> dict:
        """k_hat*(a), its speedup, the step points and the bounds (20)-(21) with delta (C.7)."""
        v = self.step_times()
        if not self.valid():
            return {"step_times": v, "error": "a predicted step time is not positive"}
        delta = (
            float(step_time_error(self.bandwidth_error)) if 0 <= self.bandwidth_error < 1 else None
        )
        table = {}
        for a in self.acceptances:
            k = best_draft_length(v, a)
            entry = {"best_draft_length": k, "speedup": float(speedup(v, a, k))}
            if delta is not None and delta < 1:
                entry["certain"] = bool(best_draft_length_is_certain(v, a, delta))
            table[str(a)] = entry
        out = {
            "step_times": v,
            "step_points": [float(p) for p in step_points(v)],
            "by_acceptance": table,
            "step_time_error": delta,
        }
        if delta is not None and delta < 1:
            out["throughput_loss_bound"] = float(throughput_loss_bound(delta))
            out["speedup_bounds"] = [float(b) for b in speedup_bounds(delta)]
        return out

    def to_dict(self, byte_share=None, bandwidth_ratio=None) -> dict:
        bound = self.saving_bound()
        out = {
            "verify_time": {k: v.tolist() for k, v in self.verify.items()},
            "expert_time": {k: v.tolist() for k, v in self.expert_time.items()},
            "saving": self.saving().tolist(),
            "saving_bound": None if bound is None else bound.tolist(),
            "crossover": self.crossover(),
            "draft_time": self.draft_time.tolist(),
            "staircase": self.staircase(),
        }
        if byte_share is not None and bandwidth_ratio and 0 <= self.bandwidth_error < 1:
            out["kernel_choice_robust"] = {
                str(n): bool(
                    kernel_choice_is_robust(
                        float(byte_share[n - 1]), float(bandwidth_ratio[n]), self.bandwidth_error
                    )
                )
                for n in bandwidth_ratio
                if n >= 2 and byte_share[n - 1] > 0
            }
        return out


def ratio_anchored(prediction: "Prediction", plain_time: float, plan_plain_time: float):
    """A version's verify times re-anchored by the ratio of the one-token times instead of
    their difference: tau_hat(n) = tau_hat_plan(n) tau_meas(1) / tau_plan(1), with
    tau_hat_plan(n) the version anchored on the plan's own tau(1). The reading for drift
    that slows every pass alike between the plan's run and this one (on these 2-core hosts
    tau(1), tau(5) and tau(9) of the demo moved by 1.50x, 1.43x and 1.28x together within
    a minute, in a session check); eq. 22's difference is the reading for drift that adds a
    fixed time."""
    ratio = plain_time / plan_plain_time
    plan_verify = {
        k: (v - plain_time) + plan_plain_time for k, v in prediction.verify.items()
    }  # the same version anchored on the plan's tau(1)
    return replace(prediction, verify={k: v * ratio for k, v in plan_verify.items()})


def anchored_predictions(
    chain: dict,
    plain_time: float,
    *,
    bandwidth_error: float,
    draft_time,
    dedup_kernel: str,
    step_kernel: str = "auto",
) -> dict[str, Prediction]:
    """The plan's three versions re-anchored on another run's tau_meas(1) (eq. 22 as meant:
    the anchor and the runs scored come from one process). chain: a plan's `Chain`
    (layer_times {version: {kernel: [L][n_max]}}, outside_growth [n_max])."""
    growth = np.asarray(chain.outside_growth)
    out = {}
    for version, tables in chain.layer_times.items():
        times = {k: np.asarray(v) for k, v in tables.items()}
        out[version] = Prediction(
            verify=verify_times(plain_time, times, growth if version == "calibrated" else None),
            expert_time={k: v.sum(axis=0) for k, v in times.items()},
            bandwidth_error=bandwidth_error,
            draft_time=np.asarray(draft_time, dtype=float),
            dedup_kernel=dedup_kernel,
            step_kernel=step_kernel,
        )
    return out
