"""Synthetic routing processes, for the shapes of models we cannot run.

`LocalityProcess` is a stationary Markov process on each layer's expert sets: token t keeps each
of token t-1's m experts independently with probability p (temporal locality) and draws the rest
without replacement from a skewed popularity pi_l over the experts not kept (a Zipf law of
exponent s over a random order of experts, fixed per layer). At p = 0 tokens are independent
draws from pi_l; with s = 0 as well, this is independent uniform routing (rho(n) = 1 - q^(n-1)).
Layers are independent. `fit(target)` finds the p whose layer-mean rho(2) is the target, e.g.
the published 0.363 (OLMoE), 0.480 (Qwen3) or 0.492 (gpt-oss) of seed 000 Fig. 1.

Each document starts after a burn-in of the chain (from a draw of pi_l), so windows anywhere in
it have the stationary law that identity (2), U(n) = m sum_j (1 - rho(j)), assumes.

Local popularity (`local_popularity` beta in [0, 1]). rho(n) says how concentrated routing is
inside a window, not whether the same experts are popular in every document. With beta = 0 one
popularity per layer serves the whole trace, so a placement fitted on some documents holds the
experts every other document uses most. With beta > 0 each document's layer routes by
(1 - beta) pi_l + beta pi_{l,d}, pi_{l,d} a Zipf law of the same exponent over the document's
own random order: the share beta of its popularity is its own. Windows inside a document have
the same kind of law whatever beta (a mixture of two Zipf laws), so rho(n) is fitted at each
beta as before; what beta sets is how well one document's popular experts predict another's.
On the one real trained routing moespec can record, the demo target (16 experts, top-2, 26
held-out documents), the process fitted to its rho(2) = 0.231 and rho(9) = 0.743 at beta = 0
puts the fit split's hottest quarter of experts under 56% of the other documents' activations,
where the recorded trace puts 29%; beta = 0.8 gives 30% (`static_coverage`,
benchmarks/routing_locality.py).
"""

import math
from collections.abc import Iterator

import numpy as np

from moespec.routing.trace import RoutingTrace

DRAW_ELEMENTS = 1 << 22  # random keys drawn at once
BATCH_ELEMENTS = 1 << 25  # expert ids simulated at once, over the documents of one batch


class LocalityProcess:
    """Keep probability p (`keep_probability`), popularity skew s (`popularity_skew`).

    fit(target_reuse2) sets `keep_probability_` (the fitted p) and `reuse2_` (the simulated
    layer-mean rho(2) at it) and returns self; sampling uses keep_probability_ when fitted.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        *,
        keep_probability: float = 0.0,
        popularity_skew: float = 0.5,
        local_popularity: float = 0.0,
    ):
        if not 1 <= top_k < num_experts:
            raise ValueError(f"top_k must be in 1..{num_experts - 1}, got {top_k}")
        if not 0 <= keep_probability < 1:
            raise ValueError(f"keep_probability must be in [0, 1), got {keep_probability}")
        if popularity_skew < 0:
            raise ValueError(f"popularity_skew must be >= 0, got {popularity_skew}")
        if not 0 <= local_popularity <= 1:
            raise ValueError(f"local_popularity must be in [0, 1], got {local_popularity}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.keep_probability = keep_probability
        self.popularity_skew = popularity_skew
        self.local_popularity = local_popularity

    @property
    def p(self) -> float:
        return getattr(self, "keep_probability_", self.keep_probability)

    def popularity(self, rng: np.random.Generator) -> np.ndarray:
        """log pi over the experts: Zipf(s) over a random order of them. [N]"""
        ranks = rng.permutation(self.num_experts) + 1
        weights = ranks.astype(float) ** -self.popularity_skew
        return np.log(weights / weights.sum())

    def document_popularity(self, log_pi: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """log of a document's popularity for a layer of popularity log_pi: (1 - beta) pi +
        beta (a Zipf law over the document's own order). beta = 0: log_pi, drawing nothing."""
        beta = self.local_popularity
        if beta == 0:
            return log_pi
        local = np.exp(self.popularity(rng))
        return np.log((1 - beta) * np.exp(log_pi) + beta * local)

    def _window_popularity(self, rng: np.random.Generator) -> np.ndarray:
        """The popularity of one document's layer, as a window statistic sees it."""
        return self.document_popularity(self.popularity(rng), rng)

    def burn_in(self, p: float) -> int:
        """Steps after which every starting expert is gone with probability >= 0.999."""
        if p == 0:
            return 0
        return min(2000, math.ceil(math.log(1e-3 / self.top_k) / math.log(p)))

    def chains(
        self, log_pi: np.ndarray, steps: int, rng: np.random.Generator, p: float | None = None
    ) -> np.ndarray:
        """Expert sets of len(log_pi) independent stationary chains: [steps, C, m].
        log_pi: [C, N], the popularity of each chain's layer."""
        p = self.p if p is None else p
        chains, m = len(log_pi), self.top_k
        out = np.empty((steps, chains, m), np.int32)
        if p == 0:  # independent tokens: draw many steps at once
            block = max(1, DRAW_ELEMENTS // (chains * self.num_experts))
            for t in range(0, steps, block):
                size = min(block, steps - t)
                keys = log_pi[None] + rng.gumbel(size=(size, chains, self.num_experts))
                out[t : t + size] = np.argpartition(-keys, m - 1, axis=-1)[..., :m]
            return out
        state = _draw(log_pi, np.zeros((chains, 0), np.int64), m, rng)
        for t in range(-self.burn_in(p), steps):
            state = self._step(state, log_pi, p, rng)
            if t >= 0:
                out[t] = state
        return out

    def _step(self, state, log_pi, p, rng):
        m = self.top_k
        keep = rng.random(state.shape) < p  # [C, m]
        order = np.argsort(~keep, axis=1, kind="stable")  # kept experts first
        kept = np.take_along_axis(state, order, axis=1)
        count = keep.sum(axis=1)[:, None]  # [C, 1]
        slot = np.arange(m)[None, :]
        fresh = _draw(log_pi, np.where(slot < count, kept, -1), m, rng)  # [C, m], best first
        refill = np.take_along_axis(fresh, np.maximum(slot - count, 0), axis=1)
        return np.where(slot < count, kept, refill)

    def simulated_reuse2(self, p: float, *, tokens: int = 100_000, seed: int = 0) -> float:
        """rho(2) of the stationary process at keep probability p, by simulation on `tokens`
        consecutive pairs (every layer has the same law, whatever its order of experts)."""
        rng = np.random.default_rng(seed)
        chains = 256
        steps = max(2, tokens // chains + 1)
        log_pi = np.stack([self._window_popularity(rng) for _ in range(chains)])
        sets = self.chains(log_pi, steps, rng, p)  # [steps, C, m]
        same = (sets[1:, :, :, None] == sets[:-1, :, None, :]).any(-1)  # [steps-1, C, m]
        return float(same.mean())

    def simulated_reuse(self, p: float, n: int, *, tokens: int = 100_000, seed: int = 0):
        """[rho(2), ..., rho(n)] of the stationary process at keep probability p, by simulation:
        rho(j) is the share of a token's experts found among the j - 1 tokens before it."""
        rng = np.random.default_rng(seed)
        chains = 256
        steps = max(n, tokens // chains + n)
        log_pi = np.stack([self._window_popularity(rng) for _ in range(chains)])
        sets = self.chains(log_pi, steps, rng, p)  # [steps, C, m]
        last = sets[n - 1 :]  # the token whose experts are looked up
        seen = np.zeros(last.shape, dtype=bool)
        out = []
        for back in range(1, n):  # the token `back` positions earlier
            earlier = sets[n - 1 - back : len(sets) - back]
            seen |= (last[..., :, None] == earlier[..., None, :]).any(-1)
            out.append(float(seen.mean()))
        return out

    def fit(self, target_reuse2: float, *, tokens: int = 100_000, seed: int = 0):
        """Find p with simulated rho(2) = target by bisection (rho(2) rises with p)."""
        if not 0 < target_reuse2 < 1:
            raise ValueError(f"target rho(2) must be in (0, 1), got {target_reuse2}")
        floor = self.simulated_reuse2(0.0, tokens=tokens, seed=seed)
        if target_reuse2 < floor:
            raise ValueError(
                f"target rho(2) = {target_reuse2} is below {floor:.3f}, what expert popularity "
                f"alone gives at skew {self.popularity_skew}: lower the skew"
            )
        low, high = 0.0, 1.0 - 1e-6
        for _ in range(14):  # p to within 2^-14
            mid = (low + high) / 2
            if self.simulated_reuse2(mid, tokens=tokens, seed=seed) < target_reuse2:
                low = mid
            else:
                high = mid
        self.keep_probability_ = (low + high) / 2
        self.reuse2_ = self.simulated_reuse2(self.keep_probability_, tokens=tokens, seed=seed)
        if abs(self.reuse2_ - target_reuse2) > 0.01:  # only a target close to 1 gets here
            raise ValueError(
                f"could not fit rho(2) = {target_reuse2}: the process reaches {self.reuse2_:.3f}"
            )
        return self

    def documents(self, num_layers: int, lengths: list[int], seed: int = 0) -> Iterator[np.ndarray]:
        """Expert ids [T_d, L, m] (int16/int32) of documents of the given lengths, in order.
        One popularity per layer for the whole trace, each document's share `local_popularity`
        of its own; documents are independent."""
        rng = np.random.default_rng(seed)
        log_pi = np.stack([self.popularity(rng) for _ in range(num_layers)])  # [L, N]
        id_dtype = np.int16 if self.num_experts <= 32768 else np.int32
        per_batch = max(1, BATCH_ELEMENTS // (num_layers * max(lengths) * self.top_k))
        for first in range(0, len(lengths), per_batch):
            batch = lengths[first : first + per_batch]
            chains = np.concatenate(  # [docs * L, N]
                [[self.document_popularity(row, rng) for row in log_pi] for _ in batch]
            )
            sets = self.chains(chains, max(batch), rng)  # [T, docs * L, m]
            sets = sets.reshape(max(batch), len(batch), num_layers, self.top_k)
            for d, length in enumerate(batch):
                yield sets[:length, d].astype(id_dtype)

    def metadata(self) -> dict:
        out = {
            "process": "locality",
            "keep_probability": self.p,
            "popularity_skew": self.popularity_skew,
            "local_popularity": self.local_popularity,
        }
        if hasattr(self, "reuse2_"):
            out["fitted_reuse2"] = self.reuse2_
        return out


def uniform_process(num_experts: int, top_k: int) -> LocalityProcess:
    """Independent uniform routing: no locality, no popularity skew."""
    return LocalityProcess(num_experts, top_k, keep_probability=0.0, popularity_skew=0.0)


def _draw(log_pi: np.ndarray, exclude: np.ndarray, m: int, rng) -> np.ndarray:
    """m experts per chain without replacement from pi, never one of `exclude` (-1: none),
    best first (Gumbel top-k: successive sampling in order). log_pi: [C, N] -> [C, m]."""
    keys = log_pi + rng.gumbel(size=log_pi.shape)
    rows, slots = np.nonzero(exclude >= 0)
    keys[rows, exclude[rows, slots]] = -np.inf
    top = np.argpartition(-keys, m - 1, axis=1)[:, :m]
    order = np.argsort(-np.take_along_axis(keys, top, axis=1), axis=1)
    return np.take_along_axis(top, order, axis=1)


def document_lengths(tokens: int, documents: int) -> list[int]:
    """Split `tokens` into `documents` near-equal lengths (the first ones one longer)."""
    if documents < 1 or tokens < documents:
        raise ValueError(f"need 1 <= documents <= tokens, got {documents} and {tokens}")
    base, extra = divmod(tokens, documents)
    return [base + (d < extra) for d in range(documents)]


def synthetic_trace(
    process: LocalityProcess,
    *,
    num_layers: int,
    tokens: int | None = None,
    documents: int = 1,
    expert_bytes: list[int] | None = None,
    layer_indices: list[int] | None = None,
    model: str = "synthetic",
    seed: int = 0,
    lengths: list[int] | None = None,
) -> RoutingTrace:
    """An in-memory synthetic trace (stream `process.documents` into a TraceWriter for big
    ones): `tokens` in `documents` near-equal documents, or documents of the given `lengths`.
    expert_bytes defaults to 1 per layer, layer_indices to 0..L-1."""
    if lengths is None:
        if tokens is None:
            raise ValueError("a synthetic trace needs tokens or document lengths")
        lengths = document_lengths(tokens, documents)
    documents = len(lengths)
    ids = list(process.documents(num_layers, lengths, seed))
    return RoutingTrace(
        expert_ids=np.concatenate(ids),
        doc_starts=np.concatenate([[0], np.cumsum(lengths)]),
        doc_names=document_names(documents),
        num_experts=process.num_experts,
        expert_bytes=list(expert_bytes or [1] * num_layers),
        layer_indices=list(layer_indices if layer_indices is not None else range(num_layers)),
        model=model,
        metadata={**process.metadata(), "seed": seed},
    )


def document_names(documents: int) -> list[str]:
    width = len(str(documents - 1))
    return [f"synthetic-{d:0{width}d}" for d in range(documents)]


def fit_popularity_skew(
    num_experts: int,
    top_k: int,
    target_reuse2: float,
    target_reuse: float,
    n: int = 9,
    *,
    tokens: int = 30_000,
    seed: int = 0,
    local_popularity: float = 0.0,
) -> tuple[float, list[float]]:
    """The popularity skew s at which the process fitted to rho(2) = `target_reuse2` gives
    rho(n) = `target_reuse` (e.g. seed 000 §2: Qwen3 0.480 and rho(9) = 0.780), by bisection
    (rho(n) rises with s at a fixed rho(2)); returns s and the simulated rho(2..n) at it.
    The largest skew tried is the one whose popularity alone gives rho(2) (p = 0)."""
    beta = local_popularity

    def process_at(skew: float) -> LocalityProcess:
        return LocalityProcess(num_experts, top_k, popularity_skew=skew, local_popularity=beta)

    low, high = 0.0, 4.0
    for _ in range(20):  # the least skew whose popularity alone exceeds the rho(2) target
        flat = process_at(high)
        if flat.simulated_reuse2(0.0, tokens=tokens, seed=seed) > target_reuse2:
            break
        high *= 2
    top = high
    for _ in range(10):
        mid = (low + high) / 2
        process = process_at(mid)
        try:
            process.fit(target_reuse2, tokens=tokens, seed=seed)
        except ValueError:  # popularity alone is above the rho(2) target: skew too high
            high = mid
            continue
        if process.simulated_reuse(process.p, n, tokens=tokens, seed=seed)[-1] < target_reuse:
            low = mid
        else:
            high = mid
    skew = low if high == top else (low + high) / 2
    try:
        process = process_at(skew).fit(target_reuse2, tokens=tokens, seed=seed)
    except ValueError:  # the midpoint's popularity alone is above the target: the lower end
        skew = low
        process = process_at(skew).fit(target_reuse2, tokens=tokens, seed=seed)
    return skew, process.simulated_reuse(process.p, n, tokens=tokens, seed=seed)
