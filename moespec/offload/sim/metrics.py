"""Scores of a simulation: hot/cold prediction accuracy and frequency sMAPE (seed 003 §4.3, App. B).

Hot/cold accuracy: at every pass and layer, a policy's forecast of which experts will be active
(utility >= tau = 1 for SpAc) against which are (slot count >= 1); the share of the N experts
predicted right, averaged over passes per layer, then over layers.

Frequency sMAPE: for consecutive passes' frequencies f_{t-1}, f_t of every (layer, expert),
2 |f_t - f_{t-1}| / (|f_t| + |f_{t-1}|), zero when both vanish (those pairs count, as zeros);
the mean over pairs, layers and experts.

History ceiling: the best hot/cold accuracy that any forecast from the last `depth` passes' slot
counts (each capped) can reach, with the forecast chosen in hindsight per layer: for every
history, "hot" where most passes that followed it had the expert active. No forecast of that
kind can score higher on the same passes, so it bounds the estimator's "u >= 1" where u
depends on those counts, and shows how much a longer memory can add (depth 1 contains the
previous-pass forecast). A bound measured on the scored passes themselves, not a forecast.
"""

import numpy as np


class AccuracyMeter:
    def __init__(self, num_layers: int):
        self.correct = np.zeros(num_layers)
        self.total = np.zeros(num_layers)

    def update(self, layer: int, predicted_hot: np.ndarray, counts: np.ndarray) -> None:
        self.correct[layer] += np.count_nonzero(predicted_hot == (counts > 0))
        self.total[layer] += len(counts)

    def value(self) -> float | None:
        seen = self.total > 0
        return float((self.correct[seen] / self.total[seen]).mean()) if seen.any() else None


class SmapeMeter:
    def __init__(self):
        self.previous = None
        self.sum = 0.0
        self.pairs = 0

    def update(self, frequencies: np.ndarray) -> None:
        """One pass's frequencies [L, N] (slot counts)."""
        f = np.asarray(frequencies, dtype=float)
        if self.previous is not None:
            self.sum += float(smape_terms(self.previous, f).sum())
            self.pairs += f.size
        self.previous = f

    def value(self) -> float | None:
        return self.sum / self.pairs if self.pairs else None


def smape_terms(previous: np.ndarray, current: np.ndarray) -> np.ndarray:
    """Elementwise 2|f_t - f_{t-1}| / (|f_t| + |f_{t-1}|), 0 where both are 0."""
    total = np.abs(previous) + np.abs(current)
    out = np.zeros_like(total, dtype=float)
    np.divide(2 * np.abs(current - previous), total, out=out, where=total > 0)
    return out


def hot_cold_accuracy(predicted_hot: np.ndarray, counts: np.ndarray) -> float | None:
    """predicted_hot [S, L, N] bool and counts [S, L, N]: accuracy averaged over layers."""
    meter = AccuracyMeter(counts.shape[1])
    for s in range(counts.shape[0]):
        for layer in range(counts.shape[1]):
            meter.update(layer, predicted_hot[s, layer], counts[s, layer])
    return meter.value()


def frequency_smape(frequencies: np.ndarray) -> float | None:
    """frequencies [S, L, N] of consecutive passes: the mean sMAPE of App. B."""
    meter = SmapeMeter()
    for f in frequencies:
        meter.update(f)
    return meter.value()


def history_ceiling(frequencies: np.ndarray, depth: int = 2, cap: int = 4) -> float | None:
    """frequencies [S, L, N] of consecutive passes: the history ceiling (module docstring).

    Scored like AccuracyMeter (passes per layer, then layers); passes before the first have
    zero counts, as they do for the previous-pass forecast.
    """
    f = np.minimum(np.asarray(frequencies, dtype=np.int64), cap)
    steps, layers, _ = f.shape
    if steps == 0 or depth < 1:
        return None
    padded = np.concatenate([np.zeros((depth, *f.shape[1:]), dtype=np.int64), f])
    key = np.zeros(f.shape, dtype=np.int64)  # the history as one integer, base cap + 1
    for j in range(1, depth + 1):
        key = key * (cap + 1) + padded[depth - j : depth - j + steps]
    active = f > 0
    per_layer = []
    for layer in range(layers):
        keys, hits = key[:, layer].ravel(), active[:, layer].ravel()
        seen = np.bincount(keys)
        on = np.bincount(keys, weights=hits, minlength=len(seen))
        per_layer.append(np.maximum(on, seen - on).sum() / len(keys))
    return float(np.mean(per_layer))
