"""How many tokens to draft: a fixed K, or k*(a_hat) from the cost model on measured step times.

auto: the acceptance a_hat is a running estimate of the geometric rate (a Beta prior, updated
per drafted position with exponential forgetting), and the step times V(k) = tau(k+1) + h(k)
come from a plan file or are measured online per pass size (running medians, linear
interpolation between measured pass sizes). k = best_draft_length(V, a_hat), seed 000 §3.3.
"""

import statistics
from collections import defaultdict, deque

from moespec.costmodel import best_draft_length

WARM_UP_TRIES = 4  # steps spent at most on measuring each warm-up pass size


class RunningMedians:
    """Median of the last `window` samples per key, with linear interpolation between keys.

    The first sample of each key is dropped: a pass of a new size pays one-time costs (library
    kernels compiled for the shape) that would otherwise stand for its step time.
    """

    def __init__(self, window: int = 16):
        self.samples = defaultdict(lambda: deque(maxlen=window))
        self.seen: set[int] = set()

    def add(self, key: int, value: float) -> None:
        if key not in self.seen:
            self.seen.add(key)
            return
        self.samples[key].append(value)

    def known(self) -> dict[int, float]:
        return {k: statistics.median(v) for k, v in sorted(self.samples.items())}

    def estimate(self, key: int, anchor: tuple[int, float] | None = None) -> float | None:
        """The median at `key`, else interpolated (or extrapolated) linearly from known keys.

        anchor: an extra known point (e.g. h(0) = 0) used only for interpolation.
        """
        points = self.known()
        if anchor is not None:
            points.setdefault(anchor[0], anchor[1])
        if key in points:
            return points[key]
        keys = sorted(points)
        if len(keys) < 2:
            return None
        below = [k for k in keys if k < key]
        above = [k for k in keys if k > key]
        if below and above:
            lo, hi = below[-1], above[0]
        elif below:
            lo, hi = below[-2], below[-1]
        else:
            lo, hi = above[0], above[1]
        slope = (points[hi] - points[lo]) / (hi - lo)
        return max(points[lo] + slope * (key - lo), 0.0)


class DraftLengthPolicy:
    """`choose()` the next draft length; `observe(...)` each step's outcome.

    draft_length: an int (fixed) or "auto". max_draft_length: k_max for auto.
    step_times: V(0..k_max), complete step times given (tests, known tables).
    verify_times: tau(1..k_max+1) from a plan; the draft's h(k) is then measured online
    (falling back to `draft_times` from the plan until a draft length has been measured).
    Neither: both measured online.
    prior: (accepted, rejected) pseudo-counts of the Beta prior on the acceptance.
    forgetting: weight kept by past observations per step (1.0 = never forget).
    probe_interval: under auto, every this many steps run a neighbour of k* (k* - 1, then
    k* + 1) once, so the step times around the optimum stay measured; and after this many
    steps at k = 0, draft one token, so the acceptance estimate can recover.
    """

    def __init__(
        self,
        draft_length: int | str = "auto",
        *,
        max_draft_length: int = 8,
        step_times: list[float] | None = None,
        verify_times: list[float] | None = None,
        draft_times: list[float] | None = None,
        prior: tuple[float, float] = (2.0, 2.0),
        forgetting: float = 0.98,
        probe_interval: int = 16,
        window: int = 16,
    ):
        if draft_length != "auto" and (not isinstance(draft_length, int) or draft_length < 0):
            raise ValueError(
                f"draft length must be 'auto' or an integer >= 0, got {draft_length!r}"
            )
        if max_draft_length < 0:
            raise ValueError(f"max draft length must be >= 0, got {max_draft_length}")
        for name, table in (("step times", step_times), ("verify times", verify_times)):
            if table is not None:
                if len(table) < 1 or any(not v > 0 for v in table):
                    raise ValueError(f"{name} must be positive, the one-token pass first")
                max_draft_length = min(max_draft_length, len(table) - 1)
        self.fixed = None if draft_length == "auto" else draft_length
        self.max_draft_length = max_draft_length
        self.given_step_times = step_times
        self.plan_verify_times = verify_times
        self.plan_draft_times = draft_times
        self.accepted, self.rejected = prior
        self.forgetting = forgetting
        self.probe_interval = probe_interval
        self.verify_times = RunningMedians(window)  # by pass size n
        self.draft_times = RunningMedians(window)  # by draft length k
        self.steps = 0
        self.plain_streak = 0
        self.since_probe = 0
        self.probes = 0
        self.warm_tries = defaultdict(int)

    @property
    def acceptance_estimate(self) -> float:
        """Posterior mean of the geometric acceptance rate."""
        return self.accepted / (self.accepted + self.rejected)

    def step_times(self) -> list[float] | None:
        """V(0..k_max): given, or tau from the plan and h measured, or both measured (None
        until two pass sizes are measured)."""
        if self.given_step_times is not None:
            return list(self.given_step_times[: self.max_draft_length + 1])
        table = []
        for k in range(self.max_draft_length + 1):
            if self.plan_verify_times is not None:
                verify = self.plan_verify_times[k]
            else:
                verify = self.verify_times.estimate(k + 1)
            measured = self.draft_times.known()
            if k in measured:
                draft = measured[k]
            elif self.plan_draft_times is not None and k < len(self.plan_draft_times):
                draft = self.plan_draft_times[k]
            else:
                draft = self.draft_times.estimate(k, anchor=(0, 0.0)) or 0.0
            if verify is None:
                return None
            table.append(max(verify + draft, 1e-9))
        return table

    def choose(self) -> int:
        if self.fixed is not None:
            return self.fixed
        if self.max_draft_length == 0:
            return 0
        if self.plan_verify_times is None and self.given_step_times is None:
            warm = self._warm_up()
            if warm is not None:
                return warm
        table = self.step_times()
        if table is None:
            return 0
        if self.plain_streak >= self.probe_interval:
            return 1
        best = best_draft_length(table, min(self.acceptance_estimate, 0.999))
        self.since_probe += 1
        if self.since_probe >= self.probe_interval:
            self.since_probe = 0
            self.probes += 1
            neighbour = best - 1 if self.probes % 2 else best + 1
            return min(max(neighbour, 0), self.max_draft_length)
        return best

    def _warm_up(self) -> int | None:
        """Measure both ends and one draft before trusting interpolation: pass sizes 1, 2 and
        k_max + 1 (a few tries each: a drafter may propose fewer tokens than asked)."""
        known = self.verify_times.known()
        for k in dict.fromkeys((0, 1, self.max_draft_length)):
            if k + 1 not in known and self.warm_tries[k] < WARM_UP_TRIES:
                self.warm_tries[k] += 1
                return k
        return None

    def observe(
        self,
        draft_length: int,
        drafted: int,
        accepted: int,
        verify_seconds: float,
        draft_seconds: float,
    ) -> None:
        """Record a step: `drafted` tokens proposed (<= draft_length), `accepted` of them."""
        self.steps += 1
        self.plain_streak = self.plain_streak + 1 if drafted == 0 else 0
        self.verify_times.add(drafted + 1, verify_seconds)
        if drafted:
            self.draft_times.add(drafted, draft_seconds)
            # Geometric acceptance: `accepted` successes, then one failure unless all passed.
            rejected = 1 if accepted < drafted else 0
            self.accepted = self.accepted * self.forgetting + accepted
            self.rejected = self.rejected * self.forgetting + rejected
