"""Linear fits of the expert operation's time to its bytes (seed 000 eq. 4 and E.1).

Per-slot:        t = t_op + c_u U b + c_re (n m - U) b
Deduplicating:   t = t_op + c_g U b + c_t n

U: distinct experts of the pass; b: bytes of one expert; n: tokens; m: experts per token.
Least squares on the passes with chosen ids (n = 2..9); scored on recorded windows, which the
fits do not see: the median relative error there is the bandwidth error epsilon (§2, §4).
Seed 000 fits each layer on its own (App. E: "per layer"); `LayerFits` holds those fits and
the pooled one over every benchmarked layer (the documented alternative, and the fit of a
layer that was not benchmarked).
Estimator contract: settings in __init__, fit(records) returns self, fitted values end in _.
"""

import statistics
from dataclasses import dataclass

import numpy as np


class _TimeFit:
    kernel = ""

    def __init__(self, top_k: int, pass_sizes: tuple[int, ...] = tuple(range(2, 10))):
        self.top_k = top_k
        self.pass_sizes = tuple(pass_sizes)

    def _features(self, n, distinct, expert_bytes) -> list[float]:
        raise NotImplementedError

    def fit(self, records: list[dict]) -> "_TimeFit":
        """records: benchmark records (kernel, n_tokens, distinct, expert_bytes, median);
        uses this kernel's chosen-id passes at the fit's pass sizes."""
        rows = [
            r
            for r in records
            if r["kernel"] == self.kernel
            and r["design"] == "chosen"
            and r["n_tokens"] in self.pass_sizes
        ]
        if len(rows) < 3:
            raise ValueError(
                f"the {self.kernel} fit needs at least 3 chosen-id passes, got {len(rows)}"
            )
        features = np.array(
            [self._features(r["n_tokens"], r["distinct"], r["expert_bytes"]) for r in rows]
        )
        times = np.array([r["median"] for r in rows])
        self.coefficients_, *_ = np.linalg.lstsq(features, times, rcond=None)
        self.n_passes_ = len(rows)
        self.residual_ = float(np.median(np.abs(features @ self.coefficients_ - times) / times))
        return self

    def predict(self, n_tokens: int, distinct: int, expert_bytes: int) -> float:
        """Predicted seconds of the expert operation on a pass."""
        return float(np.dot(self._features(n_tokens, distinct, expert_bytes), self.coefficients_))

    def relative_errors(self, records: list[dict]) -> list[float]:
        """|fit - measured| / measured on this kernel's recorded windows."""
        return [
            abs(self.predict(r["n_tokens"], r["distinct"], r["expert_bytes"]) - r["median"])
            / r["median"]
            for r in records
            if r["kernel"] == self.kernel
            and r["design"] == "window"
            and r["n_tokens"] in self.pass_sizes
        ]

    def bandwidth_error(self, records: list[dict]) -> float | None:
        """epsilon_p: the median relative error of the fit on recorded windows (§4)."""
        errors = self.relative_errors(records)
        return statistics.median(errors) if errors else None

    @property
    def fixed_time_(self) -> float:
        """t_op: the part of the time that does not grow with the bytes."""
        return float(self.coefficients_[0])


class SlotFit(_TimeFit):
    """Eq. (4): t = t_op + c_u U b + c_re (n m - U) b."""

    kernel = "slot"

    def _features(self, n, distinct, expert_bytes):
        return [1.0, distinct * expert_bytes, (n * self.top_k - distinct) * expert_bytes]

    @property
    def first_read_cost_(self) -> float:
        """c_u: seconds per byte of the first read of an expert in a pass."""
        return float(self.coefficients_[1])

    @property
    def reread_cost_(self) -> float:
        """c_re: seconds per byte of a repeated slot."""
        return float(self.coefficients_[2])

    @property
    def reread_ratio_(self) -> float:
        """c_re / c_u: 1 when a repeated slot is read again from memory, near 0 when a cache
        serves it."""
        return self.reread_cost_ / self.first_read_cost_


class DedupFit(_TimeFit):
    """Eq. (E.1): t = t_op + c_g U b + c_t n."""

    kernel = "dedup"

    def __init__(self, top_k: int, pass_sizes=tuple(range(2, 10)), kernel: str = "dedup"):
        super().__init__(top_k, pass_sizes)
        self.kernel = kernel

    def _features(self, n, distinct, expert_bytes):
        return [1.0, distinct * expert_bytes, float(n)]

    @property
    def union_cost_(self) -> float:
        """c_g: seconds per union byte."""
        return float(self.coefficients_[1])

    @property
    def token_cost_(self) -> float:
        """c_t: seconds per token of the pass."""
        return float(self.coefficients_[2])


def effective_bandwidths(records: list[dict], top_k: int, design: str = "window") -> dict:
    """beta_p(n): requested bytes over time, bytes and times summed over layers and windows
    (per-slot on n m b, deduplicating on U b), and r(n) = beta_dedup / beta_slot (Table 1)."""
    table: dict[str, dict[int, float]] = {}
    for r in records:
        if r["design"] != design:
            continue
        n = r["n_tokens"]
        requested = (r["distinct"] if r["kernel"] != "slot" else n * top_k) * r["expert_bytes"]
        bytes_, seconds = table.setdefault(r["kernel"], {}).get(n, (0.0, 0.0))
        table[r["kernel"]][n] = (bytes_ + requested, seconds + r["median"])
    bandwidth = {k: {n: b / s for n, (b, s) in sorted(v.items())} for k, v in table.items()}
    ratio = {}
    if "slot" in bandwidth:
        for kernel, values in bandwidth.items():
            if kernel != "slot":
                ratio[kernel] = {
                    n: values[n] / bandwidth["slot"][n] for n in values if n in bandwidth["slot"]
                }
    return {"bandwidth": bandwidth, "bandwidth_ratio": ratio}


def new_fit(kernel: str, top_k: int) -> _TimeFit:
    """An unfitted eq. (4) fit for the per-slot kernel, eq. (E.1) for a deduplicating one."""
    return SlotFit(top_k) if kernel == "slot" else DedupFit(top_k, kernel=kernel)


def _of_layer(records: list[dict], layer: int) -> list[dict]:
    return [r for r in records if r["layer"] == layer]


@dataclass
class LayerFits:
    """Fits per benchmarked layer and kernel, and the pooled fit over all of them.

    by_layer is empty when fitting pooled (then every layer uses `pooled`); a layer with too
    few chosen-id passes for its own fit (fewer than 3) takes the pooled fit."""

    by_layer: dict[int, dict[str, _TimeFit]]
    pooled: dict[str, _TimeFit]

    @classmethod
    def fit(cls, records: list[dict], top_k: int, kernels, per_layer: bool = True):
        pooled = {k: new_fit(k, top_k).fit(records) for k in kernels}
        by_layer = {}
        if per_layer:
            for layer in sorted({r["layer"] for r in records}):
                rows = _of_layer(records, layer)
                try:
                    by_layer[layer] = {k: new_fit(k, top_k).fit(rows) for k in kernels}
                except ValueError:  # too few passes of this layer: it takes the pooled fit
                    continue
        return cls(by_layer, pooled)

    @classmethod
    def from_plan(cls, plan) -> "LayerFits":
        """The fits a plan keeps (`Plan.fits`, pooled, and `Plan.layer_fits`), to evaluate at
        other unions than the plan's trace gave (`evaluate`: the verified text's routing)."""
        top_k = plan.model.top_k

        def fits(summaries) -> dict[str, _TimeFit]:
            out = {}
            for kernel, summary in summaries.items():
                fit = new_fit(kernel, top_k)
                fit.coefficients_ = np.asarray(summary.coefficients, dtype=float)
                fit.n_passes_ = summary.passes
                out[kernel] = fit
            return out

        by_layer = {int(layer): fits(s) for layer, s in plan.layer_fits.items()}
        return cls(by_layer, fits(plan.fits))

    @property
    def per_layer(self) -> bool:
        return bool(self.by_layer)

    def for_layer(self, layer: int) -> dict[str, _TimeFit]:
        """The fits of a layer: its own, or the pooled ones for a layer not benchmarked."""
        return self.by_layer.get(layer, self.pooled)

    def layer_errors(self, records: list[dict]) -> dict[int, dict[str, float | None]]:
        """Each layer fit's median relative error on that layer's recorded windows."""
        return {
            layer: {k: fit.bandwidth_error(_of_layer(records, layer)) for k, fit in fits.items()}
            for layer, fits in self.by_layer.items()
        }

    def kernel_errors(self, records: list[dict]) -> dict[str, float | None]:
        """epsilon_p (§4): the median over layers of each layer fit's median relative error on
        the recorded windows; pooled, the pooled fit's median error over all windows."""
        if not self.per_layer:
            return {k: fit.bandwidth_error(records) for k, fit in self.pooled.items()}
        out = {}
        for kernel in self.pooled:
            values = [e[kernel] for e in self.layer_errors(records).values()]
            values = [v for v in values if v is not None]
            out[kernel] = statistics.median(values) if values else None
        return out

    def bandwidth_error(self, records: list[dict]) -> float:
        """epsilon (§4): the larger of the two kernels' epsilon_p."""
        values = [e for e in self.kernel_errors(records).values() if e is not None]
        if not values:
            raise ValueError("no recorded window was benchmarked: epsilon is undefined")
        return max(values)
