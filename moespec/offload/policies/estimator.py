"""The Speculative Utility Estimator of MoE-SpAc (seed 003 §3.2, Algorithm 1, App. B).

Per (layer, expert) a discrete utility u in 0..K, updated once per observation window from the
expert's activation frequency f (its slot count over the window's tokens):

    u <- min(K, u + 1)   if  Delta >=  theta_up
    u <- max(0, u - 1)   if -Delta >=  theta_down
    u                    otherwise                       (inertial utility transition)

Our reading of what the paper leaves open (Algorithm 1 is not in its text):

- Delta. `reference="level"` (default) compares f_t with the frequency the current utility
  stands for, u * F / K on a linear scale of the window's F tokens: a steadily hot expert
  climbs to K and a dormant one falls to 0, so u is a level and "u >= tau" means hot.
  `reference="previous"` takes the words "frequency fluctuation" literally, Delta =
  f_t - f_{t-1}: u then follows the *trend*, and an expert that rose once keeps its utility
  while it stays busy or goes quiet slowly; on sticky synthetic routing this reading predicts
  hot/cold markedly worse (it is kept as an ablation, "spac-literal-delta").
- Boundaries are per (layer, expert) (the paper writes theta_{i,t}), initialised to
  floor(gamma / 2) with gamma the draft length (at least 1: a zero boundary would move every
  expert up at every step), and calibrated after each transition by the positivity of the
  fluctuation: a positive Delta moves theta_up, a negative one theta_down, each by an
  exponential moving average theta <- (1 - lambda) theta + lambda |Delta| with lambda = 0.1
  (lambda read as the weight of the newest fluctuation, "forgetting" 10% of the old value).
- K defaults to ceil(log2(gamma + 1)) (4 at gamma = 8), the paper's logarithmic guideline.
- The window is one verification pass (F = k + 1 tokens); without speculation (the paper's
  "w/o SD" ablation) it is the last 10 tokens, gamma = F - 1 = 9.
"""

import math
from typing import Literal

import numpy as np


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
        reference: Literal["previous", "level"] = "level",
    ):
        if window_tokens < 1:
            raise ValueError(f"window_tokens must be >= 1, got {window_tokens}")
        if not 0 < forgetting <= 1:
            raise ValueError(f"forgetting factor must be in (0, 1], got {forgetting}")
        if reference not in ("previous", "level"):
            raise ValueError(f"reference must be 'previous' or 'level', got {reference!r}")
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
        self.theta_up = np.full(shape, float(start[0]))
        self.theta_down = np.full(shape, float(start[1]))

    def update(self, layer: int, frequency: np.ndarray) -> np.ndarray:
        """Observe f [N] for one layer's window; return that layer's new utilities [N]."""
        f = np.asarray(frequency, dtype=float)
        u = self.utility[layer]
        if self.reference == "previous":
            delta = f - self.previous[layer]
        else:
            delta = f - u * (self.window_tokens / self.max_utility)
        up = delta >= self.theta_up[layer]
        down = -delta >= self.theta_down[layer]
        np.clip(u + up - down, 0, self.max_utility, out=u)
        if self.adaptive:
            lam = self.forgetting
            rising, falling = delta > 0, delta < 0
            self.theta_up[layer, rising] += lam * (delta[rising] - self.theta_up[layer, rising])
            self.theta_down[layer, falling] += lam * (
                -delta[falling] - self.theta_down[layer, falling]
            )
        self.previous[layer] = f
        return u
