"""The prediction chain, the benchmark's bookkeeping, and `plan` end to end on a tiny model."""

import json

import numpy as np
import pytest
import torch

from moespec.calibrate.bench import BenchSettings, ExpertOpBenchmark, load_raw
from moespec.calibrate.plan import make_plan
from moespec.calibrate.predict import Prediction, outside_growth, verify_times
from moespec.calibrate.texts import TRACE_TOKENS
from moespec.cli import main
from moespec.kernels import ExpertWeights
from moespec.plan import load_plan


def test_chain_22_equals_hand_computation():
    # Two layers, n = 1..3; t_slot,l(1) = 1 and 2 ms.
    times = {
        "slot": np.array([[1.0, 1.5, 2.0], [2.0, 2.5, 3.5]]) * 1e-3,
        "dedup": np.array([[1.1, 1.2, 1.3], [2.2, 2.4, 2.6]]) * 1e-3,
    }
    tau = verify_times(10e-3, times)
    assert tau["slot"] == pytest.approx([10e-3, 11e-3, 12.5e-3])
    assert tau["dedup"] == pytest.approx([10e-3, 10.6e-3, 10.9e-3])  # n = 1 runs per-slot
    growth = outside_growth(np.array([10e-3, 11.5e-3, 13.5e-3]), times)
    assert growth == pytest.approx([0, 0.5e-3, 1e-3])
    prediction = Prediction(
        verify=tau,
        expert_time={k: v.sum(0) for k, v in times.items()},
        bandwidth_error=0.05,
        draft_time=np.array([0.0, 1e-3, 2e-3]),
    )
    assert prediction.saving() == pytest.approx([0, 0.4e-3, 1.6e-3])
    assert prediction.crossover() == 2
    assert prediction.step_times() == pytest.approx([10e-3, 11.6e-3, 12.9e-3])
    bound = prediction.saving_bound()
    assert bound[1] == pytest.approx(0.05 / 0.95 * (4e-3 + 3.6e-3))


def tiny_experts():
    import torch

    generator = torch.Generator().manual_seed(0)
    return ExpertWeights(
        torch.randn(8, 16, 12, generator=generator), torch.randn(8, 12, 8, generator=generator)
    )


def test_bench_resumes_after_an_interruption(tmp_path):
    settings = BenchSettings(pass_sizes=(1, 2), chosen_levels=2, repeats=1, warmup=0, flush_bytes=0)
    bench = ExpertOpBenchmark({0: tiny_experts()}, 2, settings)
    raw = tmp_path / "bench.jsonl"
    full = bench.run(raw, progress=False)
    lines = raw.read_text().splitlines()
    kept = lines[:3]
    raw.write_text("\n".join(kept) + "\n" + lines[3][:10])  # a torn line, as after Ctrl-C
    resumed = bench.run(raw, progress=False)
    assert sorted(r["key"] for r in resumed) == sorted(r["key"] for r in full)
    assert [json.loads(line) for line in kept[1:]] == resumed[:2]  # kept, not re-timed
    assert len(load_raw(raw)) == len(full)


@pytest.mark.parametrize("invariant", [True, False])
def test_bench_times_the_products_as_the_engine_verifies(monkeypatch, invariant):
    """The expert operation is timed batch-invariant unless the settings say otherwise: the
    engine's verification passes are by default, and where a product has no batch-invariant
    multi-row form (fp32's packed product) a pass of n rows then reads its weights n times."""
    import moespec.calibrate.bench as bench_module
    from moespec.kernels import get_kernel
    from moespec.kernels.invariance import is_batch_invariant

    seen = []

    def recording(name):
        kernel = get_kernel(name)

        def run(*args):
            seen.append(is_batch_invariant())
            return kernel(*args)

        return run

    monkeypatch.setattr(bench_module, "get_kernel", recording)
    settings = BenchSettings(
        pass_sizes=(1, 3), chosen_levels=1, repeats=1, warmup=0, flush_bytes=0,
        batch_invariant=invariant,
    )  # fmt: skip
    bench = ExpertOpBenchmark({0: tiny_experts()}, 2, settings, native=False)
    for case in bench.cases():
        bench.measure(case, None)
    assert seen and set(seen) == {invariant}
    assert not is_batch_invariant()  # restored after timing
    assert BenchSettings().batch_invariant  # the default: as `generate` verifies


def test_bench_refuses_a_file_of_other_settings(tmp_path):
    raw = tmp_path / "bench.jsonl"
    ExpertOpBenchmark(
        {0: tiny_experts()}, 2, BenchSettings(pass_sizes=(1,), repeats=1, warmup=0, flush_bytes=0)
    ).run(raw, progress=False)
    other = ExpertOpBenchmark(
        {0: tiny_experts()}, 2, BenchSettings(pass_sizes=(1,), repeats=2, warmup=0, flush_bytes=0)
    )
    with pytest.raises(ValueError, match="written with other settings"):
        other.run(raw, progress=False)


@pytest.fixture(scope="module")
def text_checkpoint(checkpoint_dir, tmp_path_factory):
    """The tiny Qwen3-MoE with a tokenizer that reads text (plan records routing from text)."""
    import shutil

    from tests.checkpoints import write_text_tokenizer

    directory = tmp_path_factory.mktemp("qwen3_moe_text") / "model"
    shutil.copytree(checkpoint_dir("qwen3_moe")[0], directory)
    write_text_tokenizer(directory, 96)
    return directory


@pytest.fixture(scope="module")
def plan_dir(text_checkpoint, tmp_path_factory):
    directory = text_checkpoint
    out = tmp_path_factory.mktemp("plan")
    settings = BenchSettings(
        pass_sizes=(1, 2, 3, 4), chosen_levels=3, repeats=2, warmup=1, flush_bytes=0
    )
    make_plan(
        out,
        model_dir=directory,
        dtype="fp32",
        settings=settings,
        windows=3,
        depth=32,
        verify_repeats=2,
        progress=False,
    )
    return out, directory


def test_plan_writes_a_complete_plan_and_report(plan_dir):
    from moespec.models import load_config
    from moespec.report.plan import write_report

    out, model_dir = plan_dir
    plan = load_plan(out / "plan.json", load_config(model_dir))
    assert len(plan.verify_time) == 4 and len(plan.step_times) == 4
    assert set(plan.predictions) == {"prediction", "measured_time", "calibrated"}
    assert plan.fits["slot"].passes > 0 and plan.bandwidth_error >= 0
    assert plan.provenance.device == "cpu" and plan.provenance.settings["depth"] == 32
    # routing recorded on the corpus's documents' first TRACE_TOKENS / 24 tokens each
    assert plan.provenance.settings["trace_tokens"] == TRACE_TOKENS
    assert plan.routing.documents > 8 and plan.routing.tokens <= TRACE_TOKENS
    stages = plan.provenance.settings["stage_seconds"]  # where the plan's time went
    assert list(stages) == ["load", "routing", "bench", "verify", "draft", "predict"]
    assert all(seconds >= 0 for seconds in stages.values())
    assert sum(stages.values()) <= plan.seconds
    # timed on the target's greedy continuation of a fit document's start
    assert plan.provenance.settings["verify_text"] == "continuations"
    # both verify rounds ran: a tiny model's rounds end long before the stage's time budget
    assert plan.provenance.settings["verify_rounds"] == 2
    assert all(len(r["seconds"]) == 2 for r in plan.verify_records)
    assert plan.bench.settings["batch_invariant"] is True  # timed as `generate` verifies
    assert plan.provenance.cpu_capability == torch.backends.cpu.get_cpu_capability()
    weights = plan.weights  # formats and product paths; the CPU is the provenance's
    assert weights.experts == "fp32" and weights.byte_factor == 1
    assert weights.expert_bytes == [(2 * 32 * 64 + 64 * 32) * 4] * 2  # w_l, 2 MoE layers
    table = plan.batch  # k*(a, B), B = 1, 2, 4, 8, k = 0..3; B = 1 is the plan's own tau
    assert table.batch_sizes == [1, 2, 4, 8] and table.verify_time[1] == plan.verify_time
    assert all(len(table.verify_time[b]) == 4 for b in table.batch_sizes)
    assert set(table.best_draft_length["0.8"]) == {1, 2, 4, 8}
    assert (
        table.best_draft_length["0.8"][1]
        == plan.predictions[plan.plan_version].staircase.by_acceptance["0.8"].best_draft_length
    )
    written = write_report(plan, out)
    assert all(p.exists() for p in written)
    assert "Kernel switch" in (out / "report.md").read_text()


def test_engine_honours_the_plan(plan_dir, tmp_path, capsys):
    out, model_dir = plan_dir
    plan = json.loads((out / "plan.json").read_text())
    plan["kernel"]["crossover"] = 3
    plan["verify_time"] = [1.0, 5.0, 9.0, 13.0]  # each draft costs 4 plain steps: never draft
    edited = tmp_path / "plan.json"
    edited.write_text(json.dumps(plan))
    code = main(
        [
            "generate",
            "--model",
            str(model_dir),
            "w1 w2 w1 w2 w1",
            "--dtype",
            "fp32",
            "--max-tokens",
            "12",
            "--draft",
            "lookup",
            "--plan",
            str(edited),
            "--json",
        ]
    )
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    decode = [s for s in result["steps"] if s["phase"] == "decode"]
    assert all(s["draft_length"] == 0 for s in decode)
    code = main(
        [
            "generate",
            "--model",
            str(model_dir),
            "w1 w2 w1 w2 w1",
            "--dtype",
            "fp32",
            "--max-tokens",
            "12",
            "--draft",
            "lookup",
            "--draft-length",
            "3",
            "--plan",
            str(edited),
            "--json",
        ]
    )
    steps = [s for s in json.loads(capsys.readouterr().out)["steps"] if s["phase"] == "decode"]
    assert all(s["kernel"] == ("dedup" if s["n_tokens"] >= 3 else "slot") for s in steps)
    assert any(s["n_tokens"] >= 3 for s in steps)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda p: p.pop("verify_time"), "has no 'verify_time'"),
        (lambda p: p["kernel"].update(crossover=0), "crossover must be a pass size"),
        (lambda p: p["model"].update(num_experts=64), "made for another model: num_experts"),
        (lambda p: p.update(format="other"), "is not a moespec plan"),
        (lambda p: p.update(verify_time=[1.0, -2.0]), "positive seconds"),
    ],
)
def test_bad_plans_are_refused(plan_dir, tmp_path, change, message):
    from moespec.models import load_config

    out, model_dir = plan_dir
    plan = json.loads((out / "plan.json").read_text())
    change(plan)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    with pytest.raises(ValueError, match=message):
        load_plan(path, load_config(model_dir))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda p: p["provenance"]["machine"].update(cpu="Other CPU"), "another machine"),
        (lambda p: p["provenance"]["machine"].update(cpu_count=64), "another machine"),
        (lambda p: p["provenance"]["versions"].update(torch="1.0"), "another engine: torch"),
        (lambda p: p["weights"].update(experts="int8", dense="int8"), "another weights kind"),
    ],
)
def test_generate_refuses_a_plan_timed_on_another_clock(
    plan_dir, tmp_path, capsys, change, message
):
    out, model_dir = plan_dir
    plan = json.loads((out / "plan.json").read_text())
    change(plan)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    argv = ["generate", "--model", str(model_dir), "w1 w2", "--dtype", "fp32", "--plan", str(path)]
    assert main([*argv, "--max-tokens", "2"]) != 0
    err = capsys.readouterr().err.strip()
    assert message in err and "make a plan here" in err and len(err.splitlines()) == 1


def test_plan_file_that_is_not_json(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_plan(path)


def test_plan_refuses_to_overwrite_without_force(plan_dir, capsys):
    out, model_dir = plan_dir
    code = main(["plan", "--model", str(model_dir), "--out", str(out), "--dtype", "fp32"])
    assert code == 2 and "--force" in capsys.readouterr().err


def test_plan_refuses_a_model_whose_tokenizer_turns_text_into_one_token(checkpoint_dir, tmp_path):
    # The tests' word-level tokenizer knows no stdlib word: every token is the unknown id.
    directory, _ = checkpoint_dir("qwen3_moe")
    with pytest.raises(ValueError, match="degenerate"):
        make_plan(tmp_path, model_dir=directory, dtype="fp32", progress=False)
    assert not (tmp_path / "plan.json").exists()


def test_force_restarts_the_benchmark_instead_of_resuming_it(text_checkpoint, tmp_path):
    directory = text_checkpoint
    settings = BenchSettings(pass_sizes=(1, 2), chosen_levels=2, repeats=1, warmup=0, flush_bytes=0)
    options = dict(
        model_dir=directory,
        dtype="fp32",
        settings=settings,
        windows=2,
        depth=16,
        verify_repeats=1,
        progress=False,
    )
    make_plan(tmp_path, **options)
    raw = tmp_path / "bench.jsonl"
    lines = raw.read_text().splitlines()
    stale = json.loads(lines[1])
    stale["median"] = 123.0  # a timing from "another kernel"
    raw.write_text("\n".join([lines[0], json.dumps(stale)] + lines[2:]) + "\n")
    with pytest.raises(FileExistsError):
        make_plan(tmp_path, **options)
    make_plan(tmp_path, force=True, **options)
    assert all(r["median"] != 123.0 for r in load_raw(raw))


def small_evaluation(plan_dir, **changes):
    """The plan, its fp32 model and tokenizer, and evaluation settings small enough for a test
    (2 prompts x 2 repeats of 8 tokens, k = 0..3, two acceptances, verify passes timed in runs
    of two: one untimed, one timed; `changes` override)."""
    from moespec.calibrate.evaluate import EvaluationSettings
    from moespec.models import load_model

    out, directory = plan_dir
    plan = load_plan(out / "plan.json")
    model, tokenizer = load_model(directory, dtype="fp32")
    settings = dict(
        prompts=2,
        prompt_tokens=8,
        tokens=8,
        repeats=2,
        verify_repeats=1,
        max_draft_length=3,
        acceptances=(0.3, 0.9),
        bandwidth_bytes=1 << 20,
        stream_passes=1,
    )
    return plan, model, tokenizer, EvaluationSettings(**{**settings, **changes})


def in_process_cases(plan_dir):
    """The plan's benchmark cases, as an in-process calibration of it runs them."""
    from moespec.calibrate.inprocess import InProcessCalibration

    plan, model, tokenizer, _ = small_evaluation(plan_dir)
    return InProcessCalibration(plan, model, tokenizer, shares=1, verify_repeats=1).cases


def test_evaluation_scores_every_version_on_one_run(plan_dir, tmp_path):
    from moespec.calibrate.evaluate import evaluate

    plan, model, tokenizer, settings = small_evaluation(plan_dir)
    result = evaluate(plan, model, tokenizer, settings)
    # greedy speculative output is the plain greedy continuation in every run (fp32)
    assert result["runs_off_the_greedy_continuation"] == 0
    # phases alternate verify / sweep, each verify phase after a share of the plan's
    # calibration measured in this process; each with the read bandwidth before and after
    assert [p["phase"] for p in result["phases"]] == [
        "calibration 0",
        "verify 0",
        "sweep 0",
        "calibration 1",
        "verify 1",
        "sweep 1",
        "calibration 2",
        "verify 2",
    ]
    assert all(p["read_bandwidth_before"] > 0 for p in result["phases"])
    cell = result["sweep"]["by_acceptance"]["0.3"]
    assert set(cell["tokens_per_second"]) == {0, 1, 2, 3}
    assert all(len(runs) == 2 for runs in cell["runs"].values())  # one value per repeat
    samples = {(r["kernel"], r["n_tokens"]): r["seconds"] for r in result["verify_records"]}
    assert len(samples["slot", 4]) == 3 * 2  # three verify phases x two prompts
    # each sample's round: every round timed each (kernel, n) once, so the scorer pairs them
    rounds = {(r["kernel"], r["n_tokens"]): r["rounds"] for r in result["verify_records"]}
    assert all(len(rounds[cell]) == len(samples[cell]) for cell in samples)
    assert all(set(v) == set(rounds["slot", 1]) for v in rounds.values())
    assert len(set(rounds["slot", 1])) == 6
    assert {r.split("/")[0] for r in rounds["slot", 1]} == {"verify 0", "verify 1", "verify 2"}
    assert all("verify_error_against_medians" in v for v in result["versions"].values())
    anchor = result["anchor"]["plain_time"]
    assert anchor == pytest.approx(float(np.median(samples["slot", 1])))
    for version in ("prediction", "measured_time", "calibrated"):
        entry = result["versions"][version]
        assert entry["prediction"]["verify_time"]["slot"][0] == pytest.approx(anchor)
        assert len(entry["score"]) == 6
    # the anchored chain keeps the plan's layer-time differences, only tau(1) moves
    chain = plan.predictions["measured_time"].verify_time["dedup"]
    here = result["versions"]["measured_time"]["prediction"]["verify_time"]["dedup"]
    shift = anchor - chain[0]
    assert here == pytest.approx([t + shift for t in chain])
    # beside it, the calibrated version re-anchored by the ratio of the one-token times
    calibrated = plan.predictions["calibrated"].verify_time["slot"]
    by_ratio = result["versions"]["calibrated_by_ratio"]["prediction"]["verify_time"]["slot"]
    assert by_ratio == pytest.approx([t * anchor / calibrated[0] for t in calibrated])
    assert len(result["versions"]["calibrated_by_ratio"]["score"]) == 6
    # the plan's calibration measured again here, a share before each verify phase: every
    # benchmark case of the plan once, the plan text's passes verify_repeats times a share
    here = result["in_process"]
    assert sorted(r["key"] for r in here["bench_records"]) == sorted(
        c.key for c in in_process_cases(plan_dir)
    )
    assert here["depth"] == 8 + 8 // 2  # the plan text's passes sit where the verify phases do
    assert here["text"] == "continuations"
    whole = {(r["kernel"], r["n_tokens"]): r for r in here["verify_records"]}
    assert set(whole) == {(k, n) for k in ("slot", "dedup") for n in range(1, 5)}
    assert all(len(r["seconds"]) == 3 * 1 for r in whole.values())  # 3 shares x 1 round
    slot_here = [float(np.median(whole["slot", n]["seconds"])) for n in range(1, 5)]
    assert here["measured_verify"]["slot"] == pytest.approx(slot_here)
    assert here["plan_measured_verify"] == plan.measured_verify
    # its versions, anchored on the same tau(1): with g(n) from these passes, the per-slot
    # times are this run's plan-text passes moved to the anchor (eq. 22 + g(n), by hand)
    for version in ("prediction_here", "measured_time_here", "calibrated_here"):
        entry = result["versions"][version]
        assert entry["prediction"]["verify_time"]["slot"][0] == pytest.approx(anchor)
        assert len(entry["score"]) == 6
    calibrated_here = result["versions"]["calibrated_here"]["prediction"]["verify_time"]
    expected = [anchor + t - slot_here[0] for t in slot_here]
    assert calibrated_here["slot"] == pytest.approx(expected, rel=1e-9)
    assert 0 <= result["stream"]["decoded_reuse2"] <= 1
    # the sweep's own V(k) is the whole step as tokens/s pays it: never below its verify pass
    sweep = result["sweep"]
    assert len(sweep["step_times"]) == len(sweep["verify_step_times"]) == 4
    pairs = zip(sweep["step_times"], sweep["verify_step_times"], strict=True)
    assert all(t > v > 0 for t, v in pairs)
    # blocks order: each (acceptance, prompt)'s four draft lengths ran back to back
    log = result["sweep"]["log"]
    assert len(log) == 2 * 2 * 4 * 2  # repeats x acceptances x draft lengths x prompts
    for start in range(0, len(log), 4):
        block = log[start : start + 4]
        assert len({(a, repeat, prompt) for a, _, repeat, prompt, *_ in block}) == 1
        assert sorted(row[1] for row in block) == [0, 1, 2, 3]
    assert [row[-1] for row in log] == sorted(row[-1] for row in log)  # started in order
    # each paired speedup is a run over its own prompt's k = 0 run of the same repeat
    runs = {(a, k, r, i): t / sec for a, k, r, i, t, sec, _ in log}
    paired = cell["paired_speedup"][2]
    ratios = [runs[0.3, 2, r, i] / runs[0.3, 0, r, i] for r in range(2) for i in range(2)]
    assert paired["median"] == pytest.approx(float(np.median(ratios)))
    assert (paired["min"], paired["max"]) == pytest.approx((min(ratios), max(ratios)))


def test_evaluation_cells_order_runs_whole_cells(plan_dir):
    from moespec.calibrate.evaluate import evaluate

    plan, model, tokenizer, settings = small_evaluation(
        plan_dir, prompts=3, repeats=1, acceptances=(0.5,), sweep_order="cells", calibration="plan"
    )
    result = evaluate(plan, model, tokenizer, settings)
    # the plan's calibration only: no share of it here, no version of it scored
    assert [p["phase"] for p in result["phases"]] == ["verify 0", "sweep 0", "verify 1"]
    assert "in_process" not in result and not any(v.endswith("_here") for v in result["versions"])
    log = result["sweep"]["log"]
    assert len(log) == 4 * 3
    for start in range(0, len(log), 3):  # one cell's three prompts back to back
        block = log[start : start + 3]
        assert len({row[1] for row in block}) == 1
        assert sorted(row[3] for row in block) == [0, 1, 2]


def test_stream_versions_on_the_plans_own_routing_reproduce_its_chain(plan_dir):
    # the fits rebuilt from plan.json, evaluated at the plan's own fit documents' unions, give
    # the plan's "prediction" exactly; with g(n), the per-slot times are the plan's whole-model
    # ones, moved to the new anchor (an oracle independent of the fits: measured times)
    import numpy as np

    from moespec.calibrate.evaluate import stream_versions
    from moespec.calibrate.plan import routing_trace
    from moespec.calibrate.predict import anchored_predictions
    from moespec.progress import Progress
    from moespec.routing.reuse import split_trace

    plan, model, tokenizer, _ = small_evaluation(plan_dir)
    trace = routing_trace(model, tokenizer, None, plan_dir[1], Progress(False))
    fit = split_trace(trace, "fit") if trace.num_documents > 1 else trace
    plain = 1.5 * plan.measured_verify["slot"][0]  # another run's tau(1)
    common = dict(bandwidth_error=plan.bandwidth_error, draft_time=np.zeros(4))
    got = stream_versions(plan, fit, plain, dedup_kernel=plan.kernel.dedup_kernel, **common)
    chain = anchored_predictions(
        plan.chain, plain, dedup_kernel=plan.kernel.dedup_kernel, **common
    )["prediction"]
    for kernel, tau in chain.verify.items():
        np.testing.assert_allclose(got["prediction_stream"].verify[kernel], tau, rtol=1e-12)
    measured = np.asarray(plan.measured_verify["slot"])
    np.testing.assert_allclose(
        got["calibrated_stream"].verify["slot"], plain + measured - measured[0], rtol=1e-12
    )
    # other routing: one token repeated routes to the same m experts at every n (U = m);
    # the times by hand from plan.json's coefficients, eq. (4) and (E.1)
    repeated = np.repeat(fit.expert_ids[:1], 64, axis=0)
    one = type(fit)(
        repeated, [0, 64], ["one"], fit.num_experts, fit.expert_bytes, fit.layer_indices
    )
    low = stream_versions(plan, one, plain, dedup_kernel=plan.kernel.dedup_kernel, **common)
    m = plan.model.top_k
    for kernel in plan.fits:
        total = np.zeros(4)
        for layer, b in zip(one.layer_indices, one.expert_bytes, strict=True):
            fits = plan.layer_fits.get(layer, plan.fits)
            c, s1 = fits[kernel].coefficients, fits["slot"].coefficients
            for n in range(1, 5):
                last = (n * m - m) * b if kernel == "slot" else n
                total[n - 1] += c[0] + c[1] * m * b + c[2] * last - (s1[0] + s1[1] * m * b)
        expected = plain + total
        expected[0] = plain
        np.testing.assert_allclose(low["prediction_stream"].verify[kernel], expected, rtol=1e-9)


def test_interrupted_evaluation_resumes_from_its_journal(plan_dir, tmp_path):
    from moespec.calibrate.evaluate import EvaluationSettings, evaluate, journal_header
    from moespec.errors import SettingError
    from moespec.files import Journal
    from moespec.progress import Progress

    class StopAfter(Progress):  # the user's Ctrl-C after `runs` finished runs
        def __init__(self, runs):
            super().__init__(False)
            self.left = runs

        def advance(self, count=1):
            self.left -= 1
            if self.left == 0:
                raise KeyboardInterrupt

    plan, model, tokenizer, settings = small_evaluation(plan_dir)
    path, header = tmp_path / "evaluation.jsonl", journal_header(plan, settings)
    with pytest.raises(KeyboardInterrupt):
        evaluate(plan, model, tokenizer, settings, StopAfter(20), Journal(path, header))
    with path.open("a") as f:
        f.write('{"run": [0.3, 1')  # torn by the interruption
    finished = [e for e in Journal(path, header).entries if "run" in e]
    assert len(finished) == 20  # the 20th was journaled before its progress step
    result = evaluate(plan, model, tokenizer, settings, journal=Journal(path, header))
    # 16 runs a repeat: the first sweep and the verify phase after it had finished
    assert result["resumed"] == {
        "runs": 20,
        "phases": ["calibration 0", "verify 0", "sweep 0", "calibration 1", "verify 1"],
    }
    # the in-process calibration: the resumed shares' cases and the last share's, each once
    records = result["in_process"]["bench_records"]
    assert sorted(r["key"] for r in records) == sorted(c.key for c in in_process_cases(plan_dir))
    log = result["sweep"]["log"]
    assert len(log) == 2 * 2 * 4 * 2 and log[:20] == [e["run"] for e in finished]
    assert len({tuple(row[:4]) for row in log}) == len(log)  # every run once
    # the resumed verify phases keep their rounds: the scorer still pairs every sample
    from moespec.calibrate.score import round_paired

    paired = round_paired(result["verify_records"])
    assert paired is not None and len(paired["slot", 1]) == 3 * 2
    assert result["runs_off_the_greedy_continuation"] == 0
    # another setting, or a remade plan, never resumes this journal; --force starts afresh
    other = journal_header(plan, EvaluationSettings(repeats=3))
    with pytest.raises(SettingError, match="other settings"):
        Journal(path, other)
    assert Journal(path, other, restart=True).entries == []


def test_evaluation_settings_refuse_an_unknown_sweep_order():
    from moespec.calibrate.evaluate import EvaluationSettings

    with pytest.raises(ValueError, match="sweep_order 'rows'"):
        EvaluationSettings(sweep_order="rows")
    with pytest.raises(ValueError, match="corruption 'random'"):
        EvaluationSettings(corruption="random")
    with pytest.raises(ValueError, match="verify_mode 'alone'"):
        EvaluationSettings(verify_mode="alone")
    with pytest.raises(ValueError, match="calibration 'process'"):
        EvaluationSettings(calibration="process")
    with pytest.raises(ValueError, match="calibration_text 'code'"):
        EvaluationSettings(calibration_text="code")


def test_in_process_calibration_refuses_a_plan_made_on_a_given_trace(plan_dir):
    from dataclasses import replace

    from moespec.calibrate.inprocess import InProcessCalibration
    from moespec.errors import SettingError

    plan, model, tokenizer, _ = small_evaluation(plan_dir)
    settings = {**plan.provenance.settings, "trace": "routing.npz"}
    traced = replace(plan, provenance=replace(plan.provenance, settings=settings))
    with pytest.raises(SettingError, match="routing.npz.*calibration.*plan"):
        InProcessCalibration(traced, model, tokenizer, shares=2, verify_repeats=1)


def test_evaluate_command_offers_the_librarys_choices():
    """The command line lists its choices without importing the library: they must stay the
    library's (a mode added there is offered here, the default is the same)."""
    import argparse

    from moespec.calibrate.evaluate import CALIBRATIONS, CORRUPTIONS, EvaluationSettings
    from moespec.calibrate.inprocess import TEXTS
    from moespec.calibrate.verify import STREAM_PASSES, VERIFY_MODES
    from moespec.cli.evaluate import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    actions = {a.dest: a for a in parser._actions}
    assert tuple(actions["verify_mode"].choices) == VERIFY_MODES
    assert tuple(actions["corruption"].choices) == CORRUPTIONS
    defaults = EvaluationSettings()
    assert tuple(actions["calibration"].choices) == CALIBRATIONS
    assert actions["calibration"].default == defaults.calibration == CALIBRATIONS[0]
    assert tuple(actions["calibration_text"].choices) == TEXTS
    assert actions["calibration_text"].default == defaults.calibration_text == TEXTS[0]
    assert actions["verify_mode"].default == defaults.verify_mode == VERIFY_MODES[0]
    assert actions["stream_passes"].default == defaults.stream_passes == STREAM_PASSES
    from moespec.cli.measure_verify import add_arguments as measure_verify_arguments

    parser = argparse.ArgumentParser()
    measure_verify_arguments(parser)
    mode = next(a for a in parser._actions if a.dest == "verify_mode")
    assert tuple(mode.choices) == VERIFY_MODES and mode.default == VERIFY_MODES[0]


@pytest.mark.parametrize("corruption", ["runner-up", "uniform"])
def test_evaluation_oracle_proposes_its_corruption_for_a_wrong_draft(plan_dir, corruption):
    from moespec.calibrate.evaluate import Evaluation, evaluation_prompts
    from moespec.decoding.setup import runner_up_tokens

    _, model, tokenizer, settings = small_evaluation(plan_dir, corruption=corruption)
    prompts = evaluation_prompts(tokenizer, settings.prompts, settings.prompt_tokens)
    harness = Evaluation(model, prompts, settings)
    for index, (prompt, reference) in enumerate(zip(prompts, harness.references, strict=True)):
        # at acceptance 0 every draft is wrong
        drafts = harness.drafter(0.0, 0, index).propose(prompt + reference[:1], 4).tokens
        assert all(d != t for d, t in zip(drafts, reference[1:5], strict=True))
        runner_ups = runner_up_tokens(model, prompt, reference)[1:5]
        if corruption == "runner-up":
            assert drafts == runner_ups
        else:  # a shifted token, drawn from the whole vocabulary
            assert drafts != runner_ups


def test_evaluate_command_refuses_to_overwrite(plan_dir, tmp_path, capsys):
    out, directory = plan_dir
    existing = tmp_path / "evaluation.json"
    existing.write_text("{}")
    code = main(["evaluate", str(out), "--model", str(directory), "--out", str(existing)])
    assert code == 2
    assert "--force" in capsys.readouterr().err
    assert existing.read_text() == "{}"


def test_evaluate_command_writes_the_scorecard_and_drops_its_journal(plan_dir, tmp_path, capsys):
    out, directory = plan_dir
    target = tmp_path / "evaluation.json"
    options = ["--prompts", "1", "--prompt-tokens", "8", "--tokens", "8", "--repeats", "1"]
    command = ["evaluate", str(out), "--model", str(directory), "--out", str(target), *options]
    # a stream measurement of 4-token passes in runs of 7 spans 28 tokens: more than the 16 here
    assert main(command) == 2
    assert "--tokens or lower --stream-passes" in capsys.readouterr().err
    code = main([*command, "--stream-passes", "1"])
    assert code == 0
    assert "noise floor" in capsys.readouterr().out
    result = json.loads(target.read_text())
    assert len(result["sweep"]["log"]) == 11 * 4  # the 11 acceptances x k = 0..3, one prompt
    assert result["resumed"]["runs"] == 0
    assert not target.with_suffix(".jsonl").exists()  # the journal goes once the file is whole


def test_verify_rounds_stop_at_the_time_budget_once_enough_are_timed(text_checkpoint):
    from moespec.calibrate.texts import verify_text
    from moespec.calibrate.verify import measure_verify
    from moespec.models import load_model

    model, tokenizer = load_model(text_checkpoint, dtype="fp32")
    tokens = verify_text(tokenizer)
    common = {"depth": 32, "pass_sizes": (1, 2), "repeats": 4, "warmup": 0}
    full = measure_verify(model, tokens, **common, budget_seconds=1e6, min_repeats=2)
    cut = measure_verify(model, tokens, **common, budget_seconds=1e-9, min_repeats=2)
    assert len(full) == len(cut) == 4  # every cell, either way
    assert {len(r["seconds"]) for r in full} == {4}
    assert {len(r["seconds"]) for r in cut} == {2}  # the budget spent: stop at min_repeats
    with pytest.raises(ValueError, match="min_repeats must lie in 1..4"):
        measure_verify(model, tokens, **common, min_repeats=5)
    with pytest.raises(ValueError, match="verify time budget must be positive"):
        measure_verify(model, tokens, **common, budget_seconds=0)


def test_the_plans_verify_text_is_a_greedy_continuation_of_a_fit_documents_start(
    text_checkpoint,
):
    from moespec.calibrate.plan import plan_text
    from moespec.calibrate.texts import CONTINUATION_PROMPT, fit_documents
    from moespec.calibrate.verify import pass_span
    from moespec.decoding.setup import greedy_reference
    from moespec.models import load_model
    from moespec.progress import Progress
    from moespec.routing.record import tokenize_documents

    model, tokenizer = load_model(text_checkpoint, dtype="fp32")
    text = plan_text(model, tokenizer, "continuations", 32, 4, Progress(False))
    first, end = pass_span(32, 4)  # the stream passes of 4 tokens at depth 32
    assert len(text) == end
    prompt = min(CONTINUATION_PROMPT, first)  # the prompt ends before the first timed pass
    starts = [ids[:prompt] for _, ids in tokenize_documents(tokenizer, fit_documents(4))]
    assert text[:prompt] in starts  # a fit document's start, never a test document's
    assert text[prompt:] == greedy_reference(model, text[:prompt], end - prompt)


def test_a_plan_refuses_an_unknown_verify_text_before_loading(tmp_path):
    from moespec.errors import SettingError

    with pytest.raises(SettingError, match="verify_text='novel' is not a verify text"):
        make_plan(tmp_path / "p", model_dir=tmp_path / "missing", verify_text_kind="novel")


def test_ratio_anchoring_scales_the_plans_own_verify_times():
    from moespec.calibrate.predict import ratio_anchored

    # tau(1) was 2 ms in the plan's run and is 1 ms here; the version, anchored by difference
    # on 1 ms, grows 0.5 and 1 ms: on the plan's anchor 2, 2.5, 3 ms, scaled by 1/2.
    prediction = Prediction(
        verify={
            "slot": np.array([1.0, 1.5, 2.0]) * 1e-3,
            "dedup": np.array([1.0, 1.4, 1.7]) * 1e-3,
        },
        expert_time={"slot": np.zeros(3), "dedup": np.zeros(3)},
        bandwidth_error=0.05,
        draft_time=np.zeros(3),
    )
    scaled = ratio_anchored(prediction, 1e-3, 2e-3)
    assert scaled.verify["slot"] == pytest.approx([1e-3, 1.25e-3, 1.5e-3])
    assert scaled.verify["dedup"] == pytest.approx([1e-3, 1.2e-3, 1.35e-3])
    assert prediction.verify["slot"][2] == 2e-3  # the version itself is left as it was
    same = ratio_anchored(prediction, 1e-3, 1e-3)  # no drift: both anchorings agree
    assert same.verify["dedup"] == pytest.approx(prediction.verify["dedup"])


def test_in_process_continuations_start_from_fit_documents_only():
    """The in-process calibration's passes run on the target's greedy continuations of fit
    documents: never on a test document an evaluation scores on."""
    from moespec.calibrate.texts import fit_documents, verify_documents
    from moespec.routing.reuse import document_part

    fit = fit_documents(6)
    assert len(fit) == 6 and all(document_part(d.name) == "fit" for d in fit)
    assert not {d.name for d in fit} & {d.name for d in verify_documents(12)}
