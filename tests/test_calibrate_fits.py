"""The fits of the expert operation recover known constants from timings made by the model."""

import numpy as np
import pytest

from moespec.calibrate.fits import DedupFit, SlotFit, effective_bandwidths
from moespec.calibrate.ids import chosen_ids, distinct_count, distinct_levels, recorded_windows

B, M, N = 1_000_000, 4, 32  # bytes per expert, top-k, experts


def records(kernel, time_of, noise=0.0, seed=0, design="chosen"):
    rng = np.random.default_rng(seed)
    out = []
    for n in range(1, 10):
        for u in distinct_levels(n, M, N, 6):
            t = time_of(n, u) * (1 + noise * rng.standard_normal())
            out.append(
                {
                    "kernel": kernel,
                    "design": design,
                    "n_tokens": n,
                    "distinct": u,
                    "expert_bytes": B,
                    "median": t,
                }
            )
    return out


def slot_time(n, u):  # t_op = 50 us, c_u = 1/20 GB/s, c_re = 0.3 c_u
    return 50e-6 + u * B / 20e9 + 0.3 * (n * M - u) * B / 20e9


def dedup_time(n, u):  # t_op = 80 us, c_g = 1/16 GB/s, c_t = 15 us per token
    return 80e-6 + u * B / 16e9 + 15e-6 * n


def test_slot_fit_recovers_eq_4_exactly_without_noise():
    fit = SlotFit(M).fit(records("slot", slot_time))
    assert fit.fixed_time_ == pytest.approx(50e-6, rel=1e-6)
    assert fit.first_read_cost_ == pytest.approx(1 / 20e9, rel=1e-6)
    assert fit.reread_ratio_ == pytest.approx(0.3, rel=1e-6)


def test_dedup_fit_recovers_e1_exactly_without_noise():
    fit = DedupFit(M).fit(records("dedup", dedup_time))
    assert fit.fixed_time_ == pytest.approx(80e-6, rel=1e-6)
    assert fit.union_cost_ == pytest.approx(1 / 16e9, rel=1e-6)
    assert fit.token_cost_ == pytest.approx(15e-6, rel=1e-6)


@pytest.mark.parametrize("seed", range(5))
def test_fits_recover_constants_under_noise(seed):
    slot = SlotFit(M).fit(records("slot", slot_time, noise=0.02, seed=seed))
    dedup = DedupFit(M).fit(records("dedup", dedup_time, noise=0.02, seed=seed))
    assert slot.first_read_cost_ == pytest.approx(1 / 20e9, rel=0.1)
    assert slot.reread_ratio_ == pytest.approx(0.3, abs=0.1)
    assert dedup.union_cost_ == pytest.approx(1 / 16e9, rel=0.1)


def test_bandwidth_error_is_the_median_relative_error_on_windows_only():
    fit = SlotFit(M).fit(records("slot", slot_time))
    windows = [
        {
            "kernel": "slot",
            "design": "window",
            "n_tokens": 3,
            "distinct": 9,
            "expert_bytes": B,
            "median": slot_time(3, 9) * f,
        }
        for f in (1.1, 1.0, 0.8)
    ]
    errors = sorted(fit.relative_errors(windows + records("slot", slot_time)))
    assert errors == pytest.approx(sorted([1 - 1 / 1.1, 0.0, 0.25]))
    assert fit.bandwidth_error(windows) == pytest.approx(1 - 1 / 1.1)


def test_fit_needs_enough_passes():
    with pytest.raises(ValueError, match="at least 3 chosen-id passes"):
        SlotFit(M).fit([])


def test_effective_bandwidth_sums_bytes_and_times():
    recs = [
        {
            "kernel": "slot",
            "design": "window",
            "n_tokens": 2,
            "distinct": 6,
            "expert_bytes": B,
            "median": 1e-3,
        },
        {
            "kernel": "slot",
            "design": "window",
            "n_tokens": 2,
            "distinct": 8,
            "expert_bytes": B,
            "median": 3e-3,
        },
        {
            "kernel": "dedup",
            "design": "window",
            "n_tokens": 2,
            "distinct": 6,
            "expert_bytes": B,
            "median": 1e-3,
        },
        {
            "kernel": "dedup",
            "design": "window",
            "n_tokens": 2,
            "distinct": 8,
            "expert_bytes": B,
            "median": 1e-3,
        },
    ]
    table = effective_bandwidths(recs, M)
    assert table["bandwidth"]["slot"][2] == pytest.approx(2 * 8 * B / 4e-3)  # n m b each
    assert table["bandwidth"]["dedup"][2] == pytest.approx(14 * B / 2e-3)  # U b
    assert table["bandwidth_ratio"]["dedup"][2] == pytest.approx((14 / 2) / (16 / 4))


@pytest.mark.parametrize("n", range(1, 10))
def test_chosen_ids_name_exactly_u_experts_with_distinct_rows(n):
    rng = np.random.default_rng(n)
    for u in range(M, min(N, n * M) + 1):
        ids = chosen_ids(n, M, N, u, rng)
        assert ids.shape == (n, M)
        assert distinct_count(ids) == u
        assert all(len(set(row)) == M for row in ids.tolist())


def test_chosen_ids_refuse_impossible_counts():
    with pytest.raises(ValueError, match="distinct experts must be in 4..8"):
        chosen_ids(2, M, N, 9, np.random.default_rng(0))


def test_recorded_windows_stay_inside_documents():
    ids = np.arange(20).reshape(10, 2)  # token t selects experts 2t, 2t+1
    windows = recorded_windows(ids, np.array([0, 3, 10]), 3, 100, np.random.default_rng(0))
    starts = sorted(int(w[0, 0]) // 2 for w in windows)
    assert starts == [0, 3, 4, 5, 6, 7]  # every window of 3 tokens, none across position 3


def layer_records(layer, scale, window_error):
    """Chosen-id passes of one layer (time scaled by `scale`) and windows off by a known
    relative error."""
    out = []
    for kernel, time_of in (("slot", slot_time), ("dedup", dedup_time)):
        for design, error in (("chosen", 0.0), ("window", window_error[kernel])):
            for r in records(kernel, lambda n, u, f=time_of: scale * f(n, u), design=design):
                r["layer"] = layer
                r["median"] *= 1 + (error if design == "window" else 0.0)
                out.append(r)
    return out


def test_layer_fits_fit_each_layer_and_epsilon_is_the_paper_s():
    from moespec.calibrate.fits import LayerFits

    # Layer 0 runs at 1x, layer 3 at 2x; windows measured 10%/30% (layer 0) and 20%/40%
    # (layer 3) away from the chosen-id law (slot/dedup).
    rows = layer_records(0, 1.0, {"slot": 0.10, "dedup": 0.30}) + layer_records(
        3, 2.0, {"slot": 0.20, "dedup": 0.40}
    )
    fits = LayerFits.fit(rows, M, ["slot", "dedup"])
    assert fits.per_layer and sorted(fits.by_layer) == [0, 3]
    assert fits.for_layer(3)["slot"].fixed_time_ == pytest.approx(100e-6, rel=1e-6)
    assert fits.for_layer(0)["dedup"].token_cost_ == pytest.approx(15e-6, rel=1e-6)
    assert fits.for_layer(7) is fits.pooled  # a layer not benchmarked: the pooled fit
    # |fit - measured| / measured = e / (1 + e) on every window of a layer
    errors = fits.layer_errors(rows)
    assert errors[0]["slot"] == pytest.approx(0.1 / 1.1, rel=1e-6)
    assert errors[3]["dedup"] == pytest.approx(0.4 / 1.4, rel=1e-6)
    # epsilon_p: the median over layers; epsilon: the larger kernel's
    kernel = fits.kernel_errors(rows)
    assert kernel["slot"] == pytest.approx((0.1 / 1.1 + 0.2 / 1.2) / 2, rel=1e-6)
    assert kernel["dedup"] == pytest.approx((0.3 / 1.3 + 0.4 / 1.4) / 2, rel=1e-6)
    assert fits.bandwidth_error(rows) == pytest.approx(kernel["dedup"])
    pooled = LayerFits.fit(rows, M, ["slot", "dedup"], per_layer=False)
    assert not pooled.per_layer and pooled.for_layer(0) is pooled.pooled
