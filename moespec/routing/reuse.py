"""Reuse rho_l(n), union U_l(n) and byte share u(n) of a routing trace, with bootstrap intervals.

The estimator of seed 000 App. D.2: every window of n consecutive tokens inside a document
counts the last token's experts that an earlier token of the window also selected; the sum over
windows, divided by m x windows, is rho_hat_l(n) (eq. 1). X_l,t(n), the distinct experts of a
window, averaged over windows is U_hat_l(n); the byte share is u(n) = sum_l w_l U_l(n) / (n m W).

Everything is computed from sufficient statistics per resampling unit (sums over windows,
window counts), so a bootstrap resample of units is a weighted sum of them: 2000 resamples
cost a few matrix products. The units are the documents; with fewer than MIN_UNITS of them
(a resample of one document is that document again, and the interval collapses onto the
estimate) they are blocks of consecutive windows inside the documents, a block bootstrap
(Kunsch 1989; Carlstein 1986 for non-overlapping blocks), each window counted in the block
where it starts. T = tokens, L = MoE layers, m = experts per token, D = units, n_max = the
largest window.
"""

import hashlib
import math
import warnings
from dataclasses import dataclass, field

import numpy as np

from moespec.routing.trace import RoutingTrace

BOOTSTRAP_BATCH = 250
MIN_UNITS = 5  # fewer documents than this: resample blocks of tokens instead


@dataclass
class DocumentStatistics:
    """Sufficient statistics per unit (a document, or a block of one), for n = 1..n_max.

    windows[d, n-1]: windows of n tokens inside the unit's document that start in unit d
    (for a whole document, max(T_d - n + 1, 0));
    reused[d, l, n-1]: the sum over those windows of |S_last ∩ (S_first ∪ ... )| in layer l;
    distinct[d, l, n-1]: the sum over those windows of X_l,t(n).
    """

    windows: np.ndarray  # [D, n_max]
    reused: np.ndarray  # [D, L, n_max]
    distinct: np.ndarray  # [D, L, n_max]
    top_k: int
    expert_bytes: np.ndarray  # [L]

    @property
    def max_n(self) -> int:
        return self.windows.shape[1]


def document_statistics(
    trace: RoutingTrace,
    max_n: int = 9,
    *,
    shuffle_seed: int | None = None,
    block_tokens: int | None = None,
) -> DocumentStatistics:
    """Per-document sums of the estimators (per block of `block_tokens` window starts inside
    each document, when given). With shuffle_seed, each layer's tokens are first put in a
    random order (one permutation per layer, across documents): random pairing."""
    if max_n < 1:
        raise ValueError(f"max_n must be >= 1, got {max_n}")
    starts = np.asarray(trace.doc_starts, np.int64)
    first, end, doc_end = _units(starts, block_tokens)
    rng = None if shuffle_seed is None else np.random.default_rng(shuffle_seed)
    layers, m = trace.num_layers, trace.top_k
    reused = np.zeros((len(first), layers, max_n), np.int64)
    distinct = np.zeros_like(reused)
    for layer in range(layers):
        ids = trace.expert_ids[:, layer, :]  # [T, m]
        if rng is not None:
            ids = ids[rng.permutation(len(ids))]
        repeats = repeated_experts(ids, max_n, trace.num_experts)
        reused[:, layer], distinct[:, layer] = _window_sums(repeats, first, end, doc_end, m)
    windows = _window_counts(first, end, doc_end, max_n)
    return DocumentStatistics(windows, reused, distinct, m, np.asarray(trace.expert_bytes, float))


def _units(starts: np.ndarray, block_tokens: int | None):
    """(first, end, doc_end) [D] of the units: windows starting at first <= u0 < end, inside
    a document ending at doc_end. Whole documents, or blocks of block_tokens starts."""
    if block_tokens is None:
        return starts[:-1], starts[1:], starts[1:]
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    first, doc_end = [], []
    for start, stop in zip(starts[:-1], starts[1:], strict=True):
        block_starts = np.arange(start, max(stop, start + 1), block_tokens)
        first.append(block_starts)
        doc_end.append(np.full(len(block_starts), stop))
    first, doc_end = np.concatenate(first), np.concatenate(doc_end)
    return first, np.minimum(first + block_tokens, doc_end), doc_end


def _window_counts(first, end, doc_end, max_n: int) -> np.ndarray:
    """[D, n_max]: windows of n tokens starting in [first, end) and ending by doc_end."""
    n = np.arange(1, max_n + 1)[None, :]
    last_start = np.minimum(end[:, None], doc_end[:, None] - n + 1)  # exclusive
    return np.maximum(last_start - first[:, None], 0)


def repeated_experts(ids: np.ndarray, max_n: int, num_experts: int) -> np.ndarray:
    """R[u, j-1] = how many of token u's experts one of the j - 1 tokens before it also
    selected, j = 1..max_n; R[:, 0] = 0. ids: [T, m] for one layer.

    The lags may reach into the previous document; the window sums read R[u, j-1] only where
    u is at least the j-th token of its document, so they never see those lags."""
    tokens, m = ids.shape
    if tokens and np.any(np.diff(np.sort(ids, axis=1), axis=1) == 0):
        raise ValueError("a token selects the same expert twice in one layer")
    # Each token's expert set as a bitmask of ceil(N/64) words; experts of a token are
    # distinct, so summing their bits is or-ing them.
    word = ids.astype(np.int64) >> 6  # [T, m]
    bit = np.left_shift(np.uint64(1), (ids.astype(np.int64) & 63).astype(np.uint64))  # [T, m]
    masks = np.stack(
        [np.where(word == w, bit, np.uint64(0)).sum(axis=1) for w in range(num_experts // 64 + 1)],
        axis=1,
    )  # [T, words]
    seen = np.zeros((tokens, m), bool)
    repeats = np.zeros((tokens, max_n), np.int32)
    for lag in range(1, min(max_n, tokens)):
        earlier = masks[:-lag]  # the set of token u - lag, for u >= lag
        hit = np.take_along_axis(earlier, word[lag:], axis=1) & bit[lag:]  # [T - lag, m]
        seen[lag:] |= hit != 0
        repeats[:, lag] = seen.sum(axis=1)
    if max_n > tokens > 0:  # no token has that many predecessors: later columns repeat
        repeats[:, tokens:] = repeats[:, tokens - 1 : tokens]
    return repeats


def _window_sums(repeats: np.ndarray, first, end, doc_end, m: int):
    """(reused [D, n_max], distinct [D, n_max]) of one layer from R [T, n_max], over the
    windows that start in [first, end) of each unit and end by its doc_end.

    A window of n tokens from u0 reuses R[u0 + n - 1, n - 1] of its last token's experts and
    has X = sum_j (m - R[u0 + j - 1, j - 1]): its j-th token adds the experts no earlier token
    of the window selected. Prefix sums over tokens make every window sum two lookups.
    """
    max_n = repeats.shape[1]
    prefix = np.zeros((len(repeats) + 1, max_n), np.int64)
    np.cumsum(repeats, axis=0, out=prefix[1:])  # [T + 1, n_max]
    windows = _window_counts(first, end, doc_end, max_n)  # [D, n_max]
    reused = np.zeros((len(first), max_n), np.int64)
    distinct = np.zeros_like(reused)
    for n in range(1, max_n + 1):
        count = windows[:, n - 1]
        last = np.minimum(first + n - 1, doc_end)  # the last token of the first window
        reused[:, n - 1] = prefix[last + count, n - 1] - prefix[last, n - 1]
        for j in range(1, n + 1):
            lo = np.minimum(first + j - 1, doc_end)  # the j-th tokens of the windows
            repeated = prefix[lo + count, j - 1] - prefix[lo, j - 1]
            distinct[:, n - 1] += m * count - repeated
    return reused, distinct


@dataclass
class ReuseEstimate:
    """Point estimates (per layer and layer means) and their bootstrap intervals.

    reuse[l, n-1] = rho_hat_l(n); union[l, n-1] = U_hat_l(n); distinct_share = U/(n m);
    byte_share[n-1] = u(n). intervals[name] = [2, ...] (low, high) of each field.
    """

    reuse: np.ndarray  # [L, n_max]
    union: np.ndarray  # [L, n_max]
    distinct_share: np.ndarray  # [L, n_max]
    reuse_mean: np.ndarray  # [n_max]
    union_mean: np.ndarray  # [n_max]
    distinct_share_mean: np.ndarray  # [n_max]
    byte_share: np.ndarray  # [n_max]
    windows: np.ndarray  # [n_max], windows counted at each n
    intervals: dict = field(default_factory=dict)

    FIELDS = (
        "reuse",
        "union",
        "distinct_share",
        "reuse_mean",
        "union_mean",
        "distinct_share_mean",
        "byte_share",
    )

    def to_dict(self) -> dict:
        out = {name: _floats(getattr(self, name)) for name in self.FIELDS}
        out["windows"] = [int(w) for w in self.windows]
        out["intervals"] = {
            name: {"low": _floats(value[0]), "high": _floats(value[1])}
            for name, value in self.intervals.items()
        }
        return out


def _floats(array) -> list:
    """JSON-ready nested lists; NaN (no window of that size) becomes None."""
    values = np.asarray(array, float)
    return np.where(np.isnan(values), None, values).tolist()


def weighted_estimates(stats: DocumentStatistics, weights: np.ndarray) -> dict[str, np.ndarray]:
    """Every field of ReuseEstimate for documents weighted by weights [B, D] (a bootstrap
    resample: how many times it draws each document): arrays [B, ...]."""
    docs, layers, max_n = stats.reused.shape
    m, w = stats.top_k, stats.expert_bytes
    windows = weights @ stats.windows  # [B, n_max]
    reused = (weights @ stats.reused.reshape(docs, -1)).reshape(-1, layers, max_n)
    distinct = (weights @ stats.distinct.reshape(docs, -1)).reshape(-1, layers, max_n)
    with np.errstate(invalid="ignore", divide="ignore"):
        reuse = reused / (m * windows[:, None, :])  # [B, L, n_max]
        union = distinct / windows[:, None, :]
    n = np.arange(1, max_n + 1)
    share = union / (n * m)
    return {
        "reuse": reuse,
        "union": union,
        "distinct_share": share,
        "reuse_mean": reuse.mean(axis=1),
        "union_mean": union.mean(axis=1),
        "distinct_share_mean": share.mean(axis=1),
        # u(n) = sum_l w_l U_l(n) / (n m W), the bytes-weighted distinct share
        "byte_share": np.einsum("l,bln->bn", w, share) / w.sum(),
        "windows": windows,
    }


def estimate(
    stats: DocumentStatistics,
    *,
    bootstrap: int = 2000,
    seed: int = 0,
    confidence: float = 0.95,
    progress=None,
) -> ReuseEstimate:
    """Point estimates over all units, and percentile intervals from `bootstrap` resamples
    of the units (documents or blocks) with replacement (seeded). progress: a
    moespec.progress.Progress advanced by each resample."""
    if bootstrap < 0:
        raise ValueError(f"bootstrap must be >= 0, got {bootstrap}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    docs = len(stats.windows)
    if docs == 0:
        raise ValueError("the trace has no documents")
    point = {k: v[0] for k, v in weighted_estimates(stats, np.ones((1, docs))).items()}
    result = ReuseEstimate(**point)
    if bootstrap:
        rng = np.random.default_rng(seed)
        batches = []
        for start in range(0, bootstrap, BOOTSTRAP_BATCH):
            size = min(BOOTSTRAP_BATCH, bootstrap - start)
            counts = rng.multinomial(docs, np.full(docs, 1 / docs), size=size)  # [b, D]
            batches.append(weighted_estimates(stats, counts.astype(float)))
            if progress is not None:
                progress.advance(size)
        tail = 100 * (1 - confidence) / 2
        for name in ReuseEstimate.FIELDS:
            samples = np.concatenate([b[name] for b in batches])  # [B, ...]
            with warnings.catch_warnings():  # all NaN where no document is n tokens long
                warnings.simplefilter("ignore", RuntimeWarning)
                result.intervals[name] = np.nanpercentile(samples, [tail, 100 - tail], axis=0)
    return result


def uniform_curves(num_experts: int, top_k: int, max_n: int) -> dict[str, list[float]]:
    """Independent uniform routing: rho(n) = 1 - q^(n-1), U(n) = N (1 - q^n), and the
    distinct share U/(n m), which is also u(n) (every layer alike)."""
    from moespec.costmodel import uniform_reuse, uniform_union

    ns = range(1, max_n + 1)
    union = [float(uniform_union(num_experts, top_k, n)) for n in ns]
    return {
        "reuse": [float(uniform_reuse(num_experts, top_k, n)) for n in ns],
        "union": union,
        "distinct_share": [u / (n * top_k) for n, u in zip(ns, union, strict=True)],
    }


def static_coverage(trace: RoutingTrace, fit_tokens: int, share: float = 0.25) -> float:
    """How well one part of a trace's popular experts predict the rest's: per layer, the
    share of the activations (token slots) after the first `fit_tokens` tokens that go to
    the ceil(share N) experts most activated within them (ties: lower id), averaged over
    layers. A placement that holds that share of each layer's experts, fitted on the first
    part, hits this often on the rest; rho(n) does not say it (see routing.synthetic)."""
    if not 0 < fit_tokens < trace.num_tokens:
        raise ValueError(f"fit_tokens must be in 1..{trace.num_tokens - 1}, got {fit_tokens}")
    if not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 1], got {share}")
    ids = np.asarray(trace.expert_ids, dtype=np.int64)  # [T, L, m]
    n, held = trace.num_experts, math.ceil(share * trace.num_experts)
    covered = []
    for layer in range(ids.shape[1]):
        counts = np.bincount(ids[:fit_tokens, layer].ravel(), minlength=n)
        top = np.argsort(-counts, kind="stable")[:held]
        rest = ids[fit_tokens:, layer].ravel()
        covered.append(float(np.isin(rest, top).mean()))
    return float(np.mean(covered))


def document_part(name: str, fit_fraction: float = 0.5) -> str:
    """'fit' or 'test', from the SHA-256 of the document's name: the same on every run and
    machine, and independent of which other documents the trace holds."""
    if not 0 <= fit_fraction <= 1:
        raise ValueError(f"fit_fraction must be in [0, 1], got {fit_fraction}")
    value = int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big")
    return "fit" if value < fit_fraction * 2**64 else "test"


def split_trace(trace: RoutingTrace, part: str, fit_fraction: float = 0.5) -> RoutingTrace:
    """The documents of one part ('fit', 'test'), or the whole trace ('all')."""
    if part == "all":
        return trace
    if part not in ("fit", "test"):
        raise ValueError(f"part must be fit, test or all, got {part!r}")
    names = [n for n in trace.doc_names if document_part(n, fit_fraction) == part]
    if not names:
        raise ValueError(f"no document of the trace falls in the {part} part")
    return trace.select_documents(names)


@dataclass
class ReuseReport:
    """What `moespec reuse` prints: measured, random pairing and uniform, n = 1..n_max."""

    model: str
    num_layers: int
    num_experts: int
    top_k: int
    num_documents: int
    num_tokens: int
    bootstrap: int
    seed: int
    confidence: float
    measured: ReuseEstimate
    random_pairing: ReuseEstimate
    uniform: dict
    # what the bootstrap resampled ("documents", "blocks of 64 tokens"), or why it did not
    resampling: str | None = None
    no_interval: str | None = None

    @property
    def max_n(self) -> int:
        return len(self.measured.reuse_mean)

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "num_layers": self.num_layers,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "num_documents": self.num_documents,
            "num_tokens": self.num_tokens,
            "n_tokens": list(range(1, self.max_n + 1)),
            "bootstrap": self.bootstrap,
            "seed": self.seed,
            "confidence": self.confidence,
            "resampling": self.resampling,
            "no_interval": self.no_interval,
            "measured": self.measured.to_dict(),
            "random_pairing": self.random_pairing.to_dict(),
            "uniform": self.uniform,
        }


def reuse_report(
    trace: RoutingTrace,
    *,
    max_n: int = 9,
    bootstrap: int = 2000,
    seed: int = 0,
    confidence: float = 0.95,
    block_tokens: int | None = None,
    progress=None,
) -> ReuseReport:
    """Measured reuse with intervals, the random-pairing baseline (the same estimator after
    shuffling each layer's tokens: expert popularity without temporal locality) and the
    independent-uniform curves. The bootstrap resamples documents, or with fewer than
    MIN_UNITS of them blocks of `block_tokens` (default: block_length) inside them; with
    fewer blocks than that too it draws no interval and says why (`no_interval`)."""
    from moespec.progress import Progress

    progress = progress or Progress(False)
    resampling, no_interval = "documents", None
    if bootstrap and trace.num_documents < MIN_UNITS:
        block_tokens = block_tokens or block_length(trace.num_tokens, max_n)
        blocks = len(_units(np.asarray(trace.doc_starts, np.int64), block_tokens)[0])
        resampling = f"blocks of {block_tokens} tokens"
        if blocks < MIN_UNITS:
            resampling, no_interval = (
                None,
                (
                    f"{trace.num_documents} document(s) of {trace.num_tokens} tokens make "
                    f"{blocks} block(s) of {block_tokens}; a bootstrap needs {MIN_UNITS} or more"
                ),
            )
            bootstrap = 0
    blocks = block_tokens if resampling and resampling.startswith("blocks") else None
    settings = {"bootstrap": bootstrap, "seed": seed, "confidence": confidence}
    progress.start("counting reuse in windows of tokens", total=2 * trace.num_layers)
    statistics = []
    for shuffle in (None, seed):
        statistics.append(
            document_statistics(trace, max_n, shuffle_seed=shuffle, block_tokens=blocks)
        )
        progress.advance(trace.num_layers)
    if bootstrap:
        progress.start(f"bootstrap over {resampling}", total=2 * bootstrap, unit="resamples")
    measured, shuffled = (estimate(s, **settings, progress=progress) for s in statistics)
    return ReuseReport(
        model=trace.model,
        num_layers=trace.num_layers,
        num_experts=trace.num_experts,
        top_k=trace.top_k,
        num_documents=trace.num_documents,
        num_tokens=trace.num_tokens,
        measured=measured,
        random_pairing=shuffled,
        uniform=uniform_curves(trace.num_experts, trace.top_k, max_n),
        resampling=resampling if bootstrap else None,
        no_interval=no_interval,
        **settings,
    )


def check_not_degenerate(trace: RoutingTrace, source: str) -> None:
    """Refuse a trace in which text does not route as text: consecutive tokens always on the
    same experts (rho_hat(2) = 1) or one expert set in every window, as when a tokenizer maps
    every word to one id. Predictions from such a trace describe another workload."""
    ids = np.sort(trace.expert_ids, axis=-1)  # [T, L, m]
    top_k = ids.shape[-1]
    if len(ids) < 2:
        raise ValueError(f"{source}: the routing trace has fewer than 2 tokens")
    same_document = np.ones(len(ids) - 1, dtype=bool)
    same_document[np.asarray(trace.doc_starts[1:-1]) - 1] = False
    shared = (ids[:-1, :, :, None] == ids[1:, :, None, :]).any(-1).sum(-1) / top_k  # [T-1, L]
    reuse = float(shared[same_document].mean()) if same_document.any() else 1.0
    distinct = max(len(np.unique(ids[:, layer], axis=0)) for layer in range(ids.shape[1]))
    if reuse >= 1.0 or distinct <= 1:
        raise ValueError(
            f"{source}: the routing trace is degenerate (reuse rho(2) = {reuse:.3f}, "
            f"{distinct} distinct expert set(s) per layer): the text reaches the model as one "
            "repeated token; give the checkpoint a real tokenizer"
        )


def block_length(tokens: int, max_n: int) -> int:
    """Tokens per block of the block bootstrap: the usual T^(1/3) rate (Hall, Horowitz and
    Jing 1995), but never under 4 n_max windows, so a block holds windows of every size."""
    return max(4 * max_n, round(tokens ** (1 / 3)))
