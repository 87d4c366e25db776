"""The Speculative Utility Estimator of MoE-SpAc (seed 003 §3.2, Algorithm 1, App. B).

Per (layer, expert) a discrete utility u in 0..K, updated once per observation window from the
expert's activation frequency f (its slot count over the window's tokens):

    u <- min(K, u + 1)   if  Delta >=  theta_up
    u <- max(0, u - 1)   if -Delta >=  theta_down
    u                    otherwise                       (inertial utility transition)

What Delta is, the paper leaves open (its Algorithm 1 is not in the text). Three readings,
`reference=`:

- "count": Delta = f - u, the slot count minus the utility in raw units, as the authors' public
  release does (repository lshAlgorithm/MoE-SpAc, `StateMachine::update` in
  ggml/src/ggml-backend.cpp: up if f - u >= theta_up, else down if u - f >= theta_down, with
  theta_up = 5, theta_down = 1 and K = 5 as its constants). An expert busy once per pass at
  u = 0 climbs as soon as its count reaches theta_up; it falls once its count is below u.
- "level": compares f with the frequency the current utility stands for, u * F / K on a linear
  scale of the window's F tokens (our earlier reading): u is a level, "u >= tau" means hot, but
  an expert active once per pass rarely climbs past 1 in these scaled units.
- "previous": the words "frequency fluctuation" taken literally, Delta = f_t - f_{t-1}: u then
  follows the trend (the ablation "spac-literal-delta").

Boundaries, `adaptive=`:

- fixed: (theta_up, theta_down) = `fixed_bounds` at every step (default (3, 1); the release's
  constants are (5, 1), see `RELEASE_BOUNDS`; (1, 1), "count-unit", is SpAc's default, chosen
  as the best-scoring reading on the demo traces of benchmarks/estimator_readings.py);
- adaptive (the paper's): per (layer, expert) (theta_{i,t}), initialised to floor(gamma / 2)
  with gamma the draft length (at least 1: a zero boundary would move every expert up at every
  step), and calibrated after each transition by the positivity of the fluctuation: a positive
  Delta moves theta_up, a negative one theta_down, each by an exponential moving average
  theta <- (1 - lambda) theta + lambda |Delta| with lambda = 0.1 (lambda read as the weight of
  the newest fluctuation, "forgetting" 10% of the old value).

`READINGS` names every (Delta, boundaries) pair the benchmark scores. K defaults to
ceil(log2(gamma + 1)) (4 at gamma = 8), the paper's logarithmic guideline. The window is one
verification pass (F = k + 1 tokens); without speculation (the paper's "w/o SD" ablation) it
is the last 10 tokens, gamma = F - 1 = 9.
"""

import math
from typing import Literal

import numpy as np

RELEASE_BOUNDS = (5.0, 1.0)  # (theta_up, theta_down) of the authors' release
RELEASE_MAX_UTILITY = 5  # K of the authors' release (TOP_STAT)
REFERENCES = ("count", "level", "previous")

# name -> (reference, adaptive, fixed bounds, K or None for the guideline)
READINGS = {
    "count-release": ("count", False, RELEASE_BOUNDS, RELEASE_MAX_UTILITY),
    "count-fixed": ("count", False, (3.0, 1.0), None),
    "count-unit": ("count", False, (1.0, 1.0), None),
    "count-adaptive": ("count", True, (3.0, 1.0), None),
    "level-fixed": ("level", False, (3.0, 1.0), None),
    "level-adaptive": ("level", True, (3.0, 1.0), None),
    "previous-fixed": ("previous", False, (3.0, 1.0), None),
    "previous-adaptive": ("previous", True, (3.0, 1.0), None),
}


def default_max_utility(draft_length: int) -> int:
    """K = ceil(log2(gamma + 1)), at least 1 (§3.2)."""
    return max(1, math.ceil(math.log2(draft_length + 1)))


class UtilityEstimator:
    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        *,
        window_tokens: int,
        max_utility: int | None = None,
        forgetting: float = 0.1,
        adaptive: bool = True,
        fixed_bounds: tuple[float, float] = (3.0, 1.0),
        reference: Literal["count", "level", "previous"] = "level",
    ):
        if window_tokens < 1:
            raise ValueError(f"window_tokens must be >= 1, got {window_tokens}")
        if not 0 < forgetting <= 1:
            raise ValueError(f"forgetting factor must be in (0, 1], got {forgetting}")
        if reference not in REFERENCES:
            raise ValueError(f"reference must be one of {', '.join(REFERENCES)}, got {reference!r}")
        gamma = window_tokens - 1
        self.max_utility = max_utility or default_max_utility(gamma)
        if self.max_utility < 1:
            raise ValueError(f"max_utility K must be >= 1, got {max_utility}")
        self.window_tokens = window_tokens
        self.forgetting = forgetting
        self.adaptive = adaptive
        self.reference = reference
        shape = (num_layers, num_experts)
        self.utility = np.zeros(shape, dtype=np.int64)  # u [L, N]
        self.previous = np.zeros(shape)  # f_{t-1} [L, N]
        start = (max(gamma // 2, 1),) * 2 if adaptive else fixed_bounds
        if not (start[0] > 0 and start[1] > 0):
            raise ValueError(f"boundaries (theta_up, theta_down) must be > 0, got {start}")
        self.theta_up = np.full(shape, float(start[0]))
        self.theta_down = np.full(shape, float(start[1]))
        self._fixed = None if adaptive else (float(start[0]), -float(start[1]))

    def update(self, layer: int, frequency: np.ndarray) -> np.ndarray:
        """Observe f [N] for one layer's window; return that layer's new utilities [N]."""
        f = np.asarray(frequency, dtype=float)
        u = self.utility[layer]
        if self.reference == "previous":
            delta = f - self.previous[layer]
        elif self.reference == "count":
            delta = f - u
        else:
            delta = f - u * (self.window_tokens / self.max_utility)
        # Both boundaries are above 0, so a move up and a move down never meet.
        if self._fixed is not None:  # plain floats: cheaper than a row of the boundary arrays
            up, down = delta >= self._fixed[0], delta <= self._fixed[1]
        else:
            up, down = delta >= self.theta_up[layer], delta <= -self.theta_down[layer]
        u += up
        u -= down
        np.minimum(u, self.max_utility, out=u)  # (np.clip's checks cost more than this)
        np.maximum(u, 0, out=u)
        if self.adaptive:
            lam = self.forgetting
            rising, falling = delta > 0, delta < 0
            self.theta_up[layer, rising] += lam * (delta[rising] - self.theta_up[layer, rising])
            self.theta_down[layer, falling] += lam * (
                -delta[falling] - self.theta_down[layer, falling]
            )
        self.previous[layer] = f
        return u
