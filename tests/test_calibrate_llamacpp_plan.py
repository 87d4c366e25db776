"""Plans for llama.cpp: the verify-time fit recovers the cost model's coefficients, and the
plan measures llama.cpp, predicts k*(a) and says it in llama.cpp's flags."""

import json

import numpy as np
import pytest

from moespec.calibrate.llamacpp_plan import (
    ACCEPTANCE_GRID,
    VerifyFit,
    leave_one_out_error,
    llamacpp_flags,
    staircase,
)
from moespec.costmodel import best_draft_length, uniform_union

N = list(range(1, 10))
BYTES = [64 * 1e6 * uniform_union(64, 8, n) for n in N]  # a deduplicating pass's expert bytes


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_fit_recovers_fixed_time_per_token_cost_and_bandwidth(seed):
    rng = np.random.default_rng(seed)
    fixed, per_token, bandwidth = (
        rng.uniform(1e-3, 5e-3),
        rng.uniform(0, 1e-3),
        rng.uniform(5e9, 5e10),
    )
    seconds = [fixed + per_token * n + b / bandwidth for n, b in zip(N, BYTES, strict=True)]
    fit = VerifyFit().fit(N, BYTES, seconds)
    assert fit.fixed_ == pytest.approx(fixed, rel=1e-6)
    assert fit.per_token_ == pytest.approx(per_token, rel=1e-5, abs=1e-12)
    assert 1 / fit.seconds_per_byte_ == pytest.approx(bandwidth, rel=1e-6)
    assert leave_one_out_error(N, BYTES, seconds) == pytest.approx(0, abs=1e-9)


def test_a_term_the_data_would_make_negative_is_left_out():
    seconds = [10e-3 - 1e-4 * n for n in N]  # time falling with n: no cost can be negative
    fit = VerifyFit().fit(N, BYTES, seconds)
    assert fit.per_token_ >= 0 and fit.seconds_per_byte_ >= 0 and fit.fixed_ > 0


def test_a_time_growing_from_near_zero_keeps_its_slope():
    """Times whose unconstrained fit has a slightly negative intercept (measured on llama.cpp's
    Q8_0 OLMoE-shaped model: 22 ms at n = 1, +21 ms per token): the non-negative fit drops
    t_0, not the slope (a constant would predict every n at the mean, 113% off)."""
    seconds = [-3e-3 + 21e-3 * n for n in N]
    fit = VerifyFit().fit(N, [0.0] * len(N), seconds)
    assert fit.fixed_ == 0 and fit.per_token_ == pytest.approx(21e-3 - 3e-3 * 45 / 285, rel=1e-9)
    predicted = fit.predict(N, [0.0] * len(N))
    assert max(abs(p - s) / s for p, s in zip(predicted[1:], seconds[1:], strict=True)) < 0.1


def test_the_flags_draft_exactly_k_tokens_or_none():
    assert llamacpp_flags(0, "d.gguf") == {"speculate": False, "draft_length": 0, "args": []}
    flags = llamacpp_flags(3, "d.gguf")
    args = flags["args"]
    assert flags["speculate"] and args[args.index("--spec-draft-n-max") + 1] == "3"
    assert args[args.index("--spec-draft-n-min") + 1] == "3"
    assert args[args.index("--spec-draft-p-min") + 1] == "0"


def test_the_staircase_holds_k_star_at_every_acceptance_of_the_grid():
    steps = [10.0, 11.0, 12.5, 14.5, 17.0, 20.0, 23.5, 27.5, 32.0]
    table = staircase(steps, epsilon=0.02)
    assert list(table["by_acceptance"]) == [str(a) for a in ACCEPTANCE_GRID]
    for a in ACCEPTANCE_GRID:
        assert table["by_acceptance"][str(a)]["best_draft_length"] == best_draft_length(steps, a)
    assert table["first_draft_threshold"] == pytest.approx(0.1)


def test_the_plan_measures_llamacpp_and_prints_its_flags(tmp_path, capsys):
    pytest.importorskip("gguf", reason="the gguf package is absent")
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from moespec.cli import main
    from moespec.demo import demo_paths
    from moespec.export.gguf import export_gguf

    target, draft = demo_paths()
    export_gguf(target, tmp_path / "t.gguf", weight_type="bf16")
    export_gguf(draft, tmp_path / "d.gguf", weight_type="bf16")
    argv = ["plan", "--engine", "llamacpp", "--gguf", str(tmp_path / "t.gguf")]
    argv += ["--draft-gguf", str(tmp_path / "d.gguf"), "--model", str(target)]
    argv += ["--out", str(tmp_path / "plan"), "--verify-repeats", "2", "--max-n", "4"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert plan["engine"] == "llamacpp" and len(plan["verify_time"]) == 4
    assert plan["routing"]["source"].startswith("moespec's trace")
    assert 0 <= plan["measured_acceptance"] <= 1 and plan["draft_time"][0] == 0
    k = best_draft_length(plan["step_times"], plan["measured_acceptance"])
    assert plan["decision"]["draft_length"] == k
    assert ("--spec-draft-n-max" in printed) == (k > 0)
    assert "0.98" in printed  # the k*(a) table
    assert main(argv) == 2  # an existing plan is kept without --force
    # k* follows the measured verify times by default; the fit's version is written beside
    measured = plan["measured_verify"]["llamacpp"]
    assert plan["verify_times"] == "measured" and plan["verify_time"] == measured
    steps = [t + h for t, h in zip(measured, plan["draft_time"], strict=True)]
    assert plan["step_times"] == steps == plan["tau_versions"]["measured"]["step_times"]
    fitted = plan["tau_versions"]["fitted"]
    assert fitted["verify_time"] != measured  # a fit of four points by three terms
    assert main([*argv, "--verify-times", "fitted", "--force"]) == 0
    refit = json.loads((tmp_path / "plan" / "plan.json").read_text())
    steps = [t + h for t, h in zip(refit["verify_time"], refit["draft_time"], strict=True)]
    assert refit["verify_times"] == "fitted" and refit["step_times"] == steps
    assert refit["verify_time"] == refit["tau_versions"]["fitted"]["verify_time"]
    assert refit["verify_time"] != refit["measured_verify"]["llamacpp"]


def test_the_oracle_draft_shares_its_flags_across_draft_lengths():
    """Common random numbers: with one round's flags every k sees the same accepted run (cut
    at k), and the drafts from the first rejected position on are the stream's tokens shifted
    by that round's shifts, so they never equal the stream's."""
    import numpy as np

    from moespec.calibrate.llamacpp import oracle_draft, round_flags

    vocab = 50
    reference = [(7 * i) % vocab for i in range(40)]
    uniforms = [0.1, 0.2, 0.9, 0.3, 0.95, 0.05] + [0.5] * 34
    shifts = [1 + i % (vocab - 1) for i in range(40)]
    flags = (uniforms, shifts)
    runs = []
    for k in range(9):
        draft, accepted = oracle_draft(reference, 0, k, 0.8, flags, vocab)
        runs.append(accepted)
        assert len(draft) == k and draft[:accepted] == reference[:accepted]
        for i in range(accepted, k):
            assert draft[i] == (reference[i] + shifts[i]) % vocab != reference[i]
    # positions 0 and 1 accepted (0.1, 0.2 < 0.8), position 2 rejected (0.9): the run is 2
    assert runs == [0, 1, 2, 2, 2, 2, 2, 2, 2]
    # from position 3 (the next pass after that rejection): 0.3 accepted, 0.95 rejected
    assert oracle_draft(reference, 3, 4, 0.8, flags, vocab)[1] == 1
    # a round's flags: one uniform and one nonzero shift below the vocabulary per position
    u, s = round_flags(np.random.default_rng(0), 1000, vocab)
    assert len(u) == len(s) == 1000 and all(0 <= x < 1 for x in u)
    assert min(s) >= 1 and max(s) <= vocab - 1
    # at acceptance a, the accepted run from a position is geometric, capped at k = 8: mean
    # sum_j a^j = 1.4748 at a = 0.6 (standard error of 1,000 runs about 0.06)
    a, (u, s) = 0.6, round_flags(np.random.default_rng(1), 10_000, vocab)
    runs = [oracle_draft(range(10_000), p, 8, a, (u, s), vocab)[1] for p in range(0, 9990, 10)]
    assert abs(np.mean(runs) - sum(a**j for j in range(1, 9))) < 0.2


def test_the_one_token_pass_is_its_own_path_and_the_fit_covers_the_batched_ones():
    """A vector path for one row, 2.6x faster than a line through the batched passes says:
    τ̂(1) is the measured τ(1), τ̂(n >= 2) the fit of n >= 2 alone (exact here, so ε = 0);
    with fewer than four batched passes measured, one fit over every n as before."""
    from moespec.calibrate.llamacpp_plan import verify_prediction

    n = list(range(1, 10))
    batched = [0.030 + 0.002 * k + b / 20e9 for k, b in zip(n, BYTES, strict=True)]
    seconds = [0.012] + batched[1:]
    predicted, fit, epsilon = verify_prediction(n, BYTES, seconds)
    assert predicted[0] == 0.012
    np.testing.assert_allclose(predicted[1:], batched[1:], rtol=1e-9)
    assert epsilon == pytest.approx(0.0, abs=1e-6)
    short, _, _ = verify_prediction(n[:4], BYTES[:4], seconds[:4])
    assert short[0] != 0.012  # three batched passes: the old fit over all four
