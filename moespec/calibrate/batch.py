"""The draft length per batch size: k*(a, B) from the cost model at n = B (k + 1).

B sequences decoded together, each verifying k drafted tokens, run one pass of n = B (k + 1)
tokens, and its experts are the union of the B sequences' windows. Seed 000's chain (eq. 22)
predicts that pass from the one-layer fits at that union:

    tau_hat_B(k) = tau(1) + sum_l ( t_p,l(n, U_l^B(k + 1)) - t_l(1) ) + g_hat(n)

U_l^B(w) is measured on the plan's routing trace: the mean number of distinct experts of
layer l over B windows of w tokens, each from another fit document (random documents and
starts; windows of one draw are prefixes of each other, so U rises with w in every draw).
The kernel p is the engine's at n: from the plan's crossover, or the faster of the two where
the plan has none (the engine then measures both and keeps the faster). t_l(1) is the fit's
own one-token time, so each layer adds only its growth from one token. g_hat(n) is the growth
outside the expert operation the plan measured up to its largest pass, and beyond it the
least-squares line through g(1) = 0 (the dense products and attention grow with the rows).

Each sequence's share of the step is V_B(k) = tau_hat_B(k) / B, and k*(a, B) is the
staircase's choice on V_B (seed 000 Sec. 3.3) for a drafter that proposes at no cost
(prompt lookup, the suffix structure); a draft model's h(k) is the engine's to add per
sequence (`moespec.decoding.draft_policy`).
"""

from dataclasses import dataclass

import numpy as np

from moespec.costmodel import best_draft_length

BATCH_SIZES = (1, 2, 4, 8)
UNION_DRAWS = 256


@dataclass
class BatchPrediction:
    """tau_hat_B(k) per batch size and what it was predicted from."""

    batch_sizes: list[int]
    verify_time: dict[int, list[float]]  # B -> tau_hat_B(k), k = 0..k_max
    kernel: dict[int, list[str]]  # B -> the kernel of each pass
    union: dict[int, list[float]]  # B -> U^B(k + 1) summed over the MoE layers
    growth_slope: float  # g_hat's seconds per token beyond the measured pass sizes

    def step_times(self, batch: int) -> list[float]:
        """V_B(k) = tau_hat_B(k) / B, one sequence's share of the step."""
        return [t / batch for t in self.verify_time[batch]]

    def best_draft_lengths(self, acceptances) -> dict[str, dict[int, int]]:
        """{acceptance: {B: k*(a, B)}}."""
        return {
            f"{a:g}": {b: best_draft_length(self.step_times(b), a) for b in self.batch_sizes}
            for a in acceptances
        }


def batch_unions(
    trace, batch_sizes, width: int, *, draws: int = UNION_DRAWS, seed: int = 0
) -> dict[int, np.ndarray]:
    """{B: [L, width]} the mean distinct experts per layer of B windows of w = 1..width
    tokens from B different documents of `trace` (with repeats only when it holds fewer
    than B documents long enough)."""
    starts = np.asarray(trace.doc_starts, np.int64)
    lengths = np.diff(starts)
    usable = np.flatnonzero(lengths >= width)
    if not len(usable):
        raise ValueError(f"no document of the trace holds a window of {width} tokens")
    rng = np.random.default_rng(seed)
    layers, experts = trace.num_layers, trace.num_experts
    out = {}
    for batch in batch_sizes:
        docs = np.stack(
            [rng.choice(usable, batch, replace=len(usable) < batch) for _ in range(draws)]
        )  # [S, B]
        first = starts[docs] + (rng.random(docs.shape) * (lengths[docs] - width + 1)).astype(
            np.int64
        )
        union = np.zeros((layers, width))
        rows = np.arange(draws)[:, None]
        for layer in range(layers):
            seen = np.zeros((draws, experts), bool)
            for w in range(width):
                ids = trace.expert_ids[first + w, layer, :].reshape(draws, -1)  # [S, B m]
                seen[rows, ids] = True
                union[layer, w] = seen.sum(axis=1).mean()
        out[batch] = union
    return out


def growth_slope(growth) -> float:
    """Seconds per token of g(n) beyond the measured sizes: the least-squares line through
    g(1) = 0 (not below zero: a pass of more rows never takes less time outside)."""
    g = np.asarray(growth, float)
    tokens = np.arange(len(g), dtype=float)  # n - 1
    denominator = float(tokens @ tokens)
    return max(float(tokens @ g) / denominator, 0.0) if denominator else 0.0


def predict_batch(
    layer_fits,
    layers: list[int],
    expert_bytes: list[int],
    top_k: int,
    unions: dict[int, np.ndarray],
    plain_time: float,
    growth,
    crossover: int | None,
) -> BatchPrediction:
    """tau_hat_B(k) for every B of `unions` ({B: [L, k_max + 1]}, rows in `layers` order)."""
    growth = np.asarray(growth, float)
    slope = growth_slope(growth)
    first = {}  # t_l(1): the per-slot fit at one token and its m experts
    for row, layer in enumerate(layers):
        first[row] = layer_fits.for_layer(layer)["slot"].predict(1, top_k, expert_bytes[row])
    verify, kernels, union_sums = {}, {}, {}
    for batch, table in sorted(unions.items()):
        times, chosen = [], []
        for k in range(table.shape[1]):
            n = batch * (k + 1)
            outside = growth[n - 1] if n <= len(growth) else slope * (n - 1)
            by_kernel = {}
            for kernel in layer_fits.pooled:
                grow = sum(
                    layer_fits.for_layer(layer)[kernel].predict(n, table[row, k], expert_bytes[row])
                    - first[row]
                    for row, layer in enumerate(layers)
                )
                by_kernel[kernel] = plain_time + grow + outside
            if n == 1:
                kernel = "slot"  # one token: the engine runs the per-slot kernel
            elif crossover is not None:
                kernel = _dedup(by_kernel) if n >= crossover else "slot"
            else:
                kernel = min(by_kernel, key=by_kernel.get)
            times.append(max(float(by_kernel[kernel]), 1e-9))
            chosen.append(kernel)
        verify[batch], kernels[batch] = times, chosen
        union_sums[batch] = table.sum(axis=0).tolist()
    return BatchPrediction(sorted(unions), verify, kernels, union_sums, slope)


def _dedup(by_kernel: dict) -> str:
    return next((k for k in by_kernel if k != "slot"), "slot")
