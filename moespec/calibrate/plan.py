"""`moespec plan`: benchmark the expert operation, fit, predict, and write plan.json.

For a checkpoint: benchmark its MoE layers' expert operation on chosen ids and on recorded
windows of a routing trace (given, or recorded on the embedded corpus), fit eq. (4) and (E.1),
score the fits on the windows (epsilon), measure the whole model's verify times per kernel,
run the prediction chain in its three versions, and write the plan: the crossover the engine
switches kernels at, and the verify times V(k) the draft-length policy reads.

For a named shape (random weights of real expert shapes, one layer): the same benchmark and
fits on a synthetic trace fitted to the published reuse; the plan then holds the expert
operation's crossover and bandwidths (there is no whole model to measure).
"""

import itertools
import json
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

import moespec
from moespec.calibrate.bench import BenchSettings, ExpertOpBenchmark
from moespec.calibrate.fits import DedupFit, SlotFit, effective_bandwidths
from moespec.calibrate.ids import recorded_windows
from moespec.calibrate.predict import (
    Prediction,
    outside_growth,
    times_from_fits,
    times_from_measurements,
    verify_times,
)
from moespec.calibrate.timing import read_bandwidth
from moespec.calibrate.verify import measure_draft_time, measure_verify, verify_table
from moespec.demo import describe
from moespec.files import output_directory, write_json
from moespec.kernels import ExpertWeights
from moespec.progress import Progress, using
from moespec.routing.reuse import (
    check_not_degenerate,
    document_part,
    document_statistics,
    estimate,
    split_trace,
)
from moespec.routing.trace import RoutingTrace

PLAN_FORMAT = "moespec-plan/1"


def stdlib_documents(count: int = 24, max_chars: int = 6000):
    """The embedded corpus for measuring: held-out standard-library files (never trained on by
    the demo models), at most `count` of them, each cut to `max_chars` characters."""
    from moespec.demo.corpus import held_out_documents

    return held_out_documents(count, max_chars)


def verify_documents(count: int = 4, max_chars: int = 20000):
    """Held-out files of the test part (`document_part`) for whole-model verify times: never
    in the fit part that U(n) and the benchmark windows come from."""
    from moespec.demo.corpus import held_out_documents

    documents = (
        d for d in held_out_documents(max_chars=max_chars) if document_part(d.name) == "test"
    )
    return list(itertools.islice(documents, count))


def model_signature(config) -> dict:
    """What a plan must match to be used with a model."""
    return {
        "name": config.name,
        "model_type": config.model_type,
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "num_experts": config.num_experts,
        "top_k": config.top_k,
        "moe_intermediate_size": config.moe_intermediate_size,
    }


def windows_by_layer(trace: RoutingTrace, layers: list[int], pass_sizes, count: int, seed: int):
    """{decoder layer: {n: [W, n, m]}} recorded windows of the trace's fit documents."""
    fit = split_trace(trace, "fit") if trace.num_documents > 1 else trace
    rng = np.random.default_rng(seed)
    out = {}
    for layer in layers:
        column = trace.layer_indices.index(layer)
        ids = fit.expert_ids[:, column, :]
        out[layer] = {n: recorded_windows(ids, fit.doc_starts, n, count, rng) for n in pass_sizes}
    return out


def fit_all(records: list[dict], top_k: int, kernels) -> tuple[dict, dict]:
    """Fits per kernel and the bandwidth error of each (median relative error on windows)."""
    fits, errors = {}, {}
    for kernel in kernels:
        fit = SlotFit(top_k) if kernel == "slot" else DedupFit(top_k, kernel=kernel)
        fits[kernel] = fit.fit(records)
        errors[kernel] = fit.bandwidth_error(records)
    return fits, errors


def bench_and_fit(experts, top_k, settings, windows_ids, header, out_dir, progress, force):
    """Benchmark the layers' expert operation (raw timings to out_dir/bench.jsonl, resumed
    after an interruption unless `force` restarts it), fit each kernel, score the fits on
    the windows; (records, kernels, dedup kernel, fits, errors, bandwidth tables)."""
    raw = Path(out_dir) / "bench.jsonl"
    if force:
        raw.unlink(missing_ok=True)
    bench = ExpertOpBenchmark(experts, top_k, settings, windows_ids, header=header)
    records = bench.run(raw, progress=progress)
    kernels = [k for k in settings.kernels if k != "reference"]
    dedup_kernel = next(k for k in kernels if k != "slot")
    fits, errors = fit_all(records, top_k, kernels)
    return records, kernels, dedup_kernel, fits, errors, effective_bandwidths(records, top_k)


def fit_summary(fits: dict, errors: dict) -> dict:
    out = {}
    for kernel, fit in fits.items():
        entry = {
            "coefficients": [float(c) for c in fit.coefficients_],
            "fixed_time": fit.fixed_time_,
            "bandwidth_error": errors[kernel],
            "passes": fit.n_passes_,
        }
        if isinstance(fit, SlotFit):
            entry.update(
                first_read_cost=fit.first_read_cost_,
                reread_cost=fit.reread_cost_,
                reread_ratio=fit.reread_ratio_,
            )
        else:
            entry.update(union_cost=fit.union_cost_, token_cost=fit.token_cost_)
        out[kernel] = entry
    return out


def make_plan(out_dir: Path, *, progress: Progress | bool = True, **options) -> dict:
    """Run the whole chain for a checkpoint directory; write out_dir/plan.json (+ raw files).

    options: those of `plan_chain` (model_dir, draft_dir, trace_path, dtype, settings,
    windows, bench_layers, depth, verify_repeats, force). progress: a Progress to report
    each stage into, or whether to show one. An interruption keeps bench.jsonl (the next
    run resumes from it) and leaves no empty out_dir behind.
    """
    with using(progress) as bar, output_directory(out_dir):
        return plan_chain(Path(out_dir), progress=bar, **options)


def plan_chain(
    out_dir: Path,
    *,
    model_dir: Path | None = None,
    draft_dir: Path | None = None,
    trace_path: Path | None = None,
    dtype: str = "bf16",
    weights: str | None = None,
    settings: BenchSettings | None = None,
    windows: int = 12,
    bench_layers: list[int] | None = None,
    depth: int = 256,
    verify_repeats: int = 10,
    force: bool = False,
    progress: Progress,
) -> dict:
    """The chain of make_plan, in an existing out_dir."""
    from moespec.models import load_model
    from moespec.routing.record import record_trace, tokenize_documents

    started = time.perf_counter()
    settings = settings or BenchSettings()
    plan_path = out_dir / "plan.json"
    if plan_path.exists() and not force:
        raise FileExistsError(f"{plan_path} already exists (pass --force to overwrite it)")
    progress.start(f"loading {model_dir}")
    model, tokenizer = load_model(model_dir, dtype=dtype, weights=weights)
    config = model.config
    if not config.is_moe:
        raise ValueError(f"{model_dir} is not an MoE model: there is no expert operation to plan")
    moe_layers = list(model.moe_blocks)
    layers = bench_layers or (
        moe_layers if len(moe_layers) <= 4 else [moe_layers[0], moe_layers[len(moe_layers) // 2]]
    )
    unknown = [layer for layer in layers if layer not in moe_layers]
    if unknown:
        raise ValueError(f"layers {unknown} are not MoE layers of {model_dir} ({moe_layers})")

    if trace_path is not None:
        from moespec.routing.store import read_trace

        trace = read_trace(trace_path)
        if trace.num_experts != config.num_experts or list(trace.layer_indices) != moe_layers:
            raise ValueError(f"{trace_path} was not recorded from this model's routing")
    else:
        # the embedded corpus's longer files are cut to the model's context
        progress.start("recording routing on the embedded corpus")
        trace = record_trace(model, tokenizer, stdlib_documents(), truncate="right")
    check_not_degenerate(trace, str(trace_path or model_dir))
    # U(n) from the trace's fit documents, verify times on test documents (kept disjoint).
    text = [t for _, ids in tokenize_documents(tokenizer, verify_documents()) for t in ids]

    windows_ids = windows_by_layer(trace, layers, settings.pass_sizes, windows, settings.seed)
    measured = bench_and_fit(
        {layer: model.moe_blocks[layer].experts for layer in layers},
        config.top_k,
        settings,
        windows_ids,
        {"model": config.name, "dtype": dtype, **({"weights": weights} if weights else {})},
        out_dir,
        progress,
        force,
    )
    records, kernels, dedup_kernel, fits, errors, bandwidths = measured
    epsilon = max(e for e in errors.values() if e is not None)

    max_n = max(settings.pass_sizes)
    fit_trace = split_trace(trace, "fit") if trace.num_documents > 1 else trace
    routing = estimate(document_statistics(fit_trace, max_n), bootstrap=0)
    expert_bytes = [model.moe_blocks[layer].experts.bytes_per_expert for layer in moe_layers]
    fitted_times = times_from_fits(fits, routing.union, expert_bytes, config.top_k)
    measured_times = times_from_measurements(records, moe_layers, max_n)

    verify_records = measure_verify(
        model,
        text,
        depth=depth,
        pass_sizes=settings.pass_sizes,
        kernels=kernels,
        repeats=verify_repeats,
        progress=progress,
    )
    measured = {k: np.array(verify_table(verify_records, k, max_n)) for k in kernels}
    plain = float(measured["slot"][0])
    if draft_dir is not None:
        progress.start(f"measuring the draft's step times h(k) ({draft_dir})")
        draft, draft_tokenizer = load_model(draft_dir, dtype=dtype)
        if not tokenizer.same_vocabulary(draft_tokenizer):
            raise ValueError(f"the draft at {draft_dir} has a different tokenizer vocabulary")
        draft_time = np.array(
            measure_draft_time(draft, text, depth=depth, max_draft_length=max_n - 1)
        )
    else:
        draft_time = np.zeros(max_n)

    versions = {}
    for name, times, growth in [
        ("prediction", fitted_times, None),
        ("measured_time", measured_times, None),
        ("calibrated", measured_times, outside_growth(measured["slot"], measured_times)),
    ]:
        prediction = Prediction(
            verify=verify_times(plain, times, growth),
            expert_time={k: v.sum(axis=0) for k, v in times.items()},
            bandwidth_error=epsilon,
            draft_time=draft_time,
            dedup_kernel=dedup_kernel,
        )
        versions[name] = (
            prediction,
            prediction.to_dict(
                routing.byte_share, bandwidths["bandwidth_ratio"].get(dedup_kernel, {})
            ),
        )
    chosen, chosen_name = versions["calibrated"][0], "calibrated"
    if not chosen.valid():  # fall back on the whole-model measurement itself
        chosen_name = "measured"
        chosen = Prediction(
            verify=measured,
            expert_time=chosen.expert_time,
            bandwidth_error=epsilon,
            draft_time=draft_time,
            dedup_kernel=dedup_kernel,
        )
    plan = {
        "format": PLAN_FORMAT,
        "model": model_signature(config),
        "model_dir": describe(model_dir),
        "draft_dir": describe(draft_dir) if draft_dir else None,
        "dtype": dtype,
        "device": "cpu",
        "versions": {"moespec": moespec.__version__, "torch": torch.__version__},
        "threads": torch.get_num_threads(),
        "weights": weight_provenance(model.expert_format, model.dense_format, expert_bytes),
        "bench": {
            "settings": asdict(settings),
            "layers": layers,
            "windows_per_pass": windows,
            "raw": "bench.jsonl",
        },
        "read_bandwidth": read_bandwidth(),
        "fits": fit_summary(fits, errors),
        "bandwidth_error": epsilon,
        "bandwidth": {
            k: {str(n): v for n, v in t.items()} for k, t in bandwidths["bandwidth"].items()
        },
        "bandwidth_ratio": {
            k: {str(n): v for n, v in t.items()} for k, t in bandwidths["bandwidth_ratio"].items()
        },
        "routing": {
            "documents": trace.num_documents,
            "tokens": trace.num_tokens,
            "byte_share": routing.byte_share.tolist(),
            "reuse_mean": routing.reuse_mean.tolist(),
            "union": routing.union.tolist(),
        },
        "measured_verify": {k: v.tolist() for k, v in measured.items()},
        "verify_records": verify_records,
        "predictions": {name: d for name, (_, d) in versions.items()},
        "plan_version": chosen_name,
        "kernel": {"crossover": chosen.crossover(), "dedup_kernel": dedup_kernel},
        "verify_time": chosen.auto_verify().tolist(),
        "draft_time": draft_time.tolist(),
        "step_times": chosen.step_times(),
        "seconds": None,
    }
    plan["seconds"] = time.perf_counter() - started
    write_json(plan_path, plan, force=force)
    return plan


def load_plan(path: Path, config=None) -> dict:
    """A plan file, validated; with a model config, checked to be that model's plan."""
    path = Path(path)
    try:
        plan = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such plan file") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(plan, dict) or plan.get("format") != PLAN_FORMAT:
        raise ValueError(f"{path} is not a moespec plan (format {PLAN_FORMAT})")
    for key in ("model", "kernel", "verify_time", "draft_time"):
        if key not in plan:
            raise ValueError(f"{path} has no {key!r}: not a complete plan")
    times = plan["verify_time"]
    if (
        not isinstance(times, list)
        or not times
        or any(not isinstance(t, int | float) or t <= 0 for t in times)
    ):
        raise ValueError(f"{path}: verify_time must be a list of positive seconds")
    crossover = plan["kernel"].get("crossover")
    if crossover is not None and (not isinstance(crossover, int) or crossover < 1):
        raise ValueError(f"{path}: kernel.crossover must be a pass size >= 1 or null")
    if config is not None:
        expected = model_signature(config)
        recorded = plan["model"]
        for key, value in expected.items():
            if key != "name" and recorded.get(key) != value:
                raise ValueError(
                    f"{path} was made for another model: {key} is {recorded.get(key)!r} "
                    f"there and {value!r} here"
                )
    return plan


def weight_provenance(expert_format, dense_format, expert_bytes: list[int]) -> dict:
    """The plan's weight formats and product paths (moespec.kernels.cpu), with w_l as held
    and the byte factor f_l (seed 000 Table 6): both kernels read each expert's held bytes
    (int8 values and scales, or the dtype's) once per read, so f_l = 1 in either format."""
    from moespec.kernels.cpu import weight_paths

    paths = weight_paths(expert_format, dense_format)
    return {**paths, "expert_bytes": expert_bytes, "byte_factor": 1}


def random_experts(
    shape, dtype: torch.dtype, seed: int = 0, weights: str | None = None
) -> ExpertWeights:
    """One layer of random experts of a named shape's real dimensions (int8 with
    weights="int8"), held as a loaded model holds them."""
    generator = torch.Generator().manual_seed(seed)
    e, h, i = shape.num_experts, shape.hidden_size, shape.expert_intermediate_size
    gate_up = (torch.randn(e, 2 * i, h, generator=generator) * 0.02).to(dtype)
    down = (torch.randn(e, h, i, generator=generator) * 0.02).to(dtype)
    experts = ExpertWeights(gate_up, down)
    if weights in ("int8", "int8-experts"):
        return experts.quantize_int8()
    return experts.pack()


def make_shape_plan(out_dir: Path, *, progress: Progress | bool = True, **options) -> dict:
    """One full-size layer of random weights of a named shape (see `shape_plan_chain` for
    the options); progress and interruptions as for make_plan."""
    with using(progress) as bar, output_directory(out_dir):
        return shape_plan_chain(Path(out_dir), progress=bar, **options)


def shape_plan_chain(
    out_dir: Path,
    *,
    shape_name: str,
    reuse2: float | None = None,
    dtype: str = "bf16",
    weights: str | None = None,
    settings: BenchSettings | None = None,
    windows: int = 12,
    tokens: int = 20000,
    force: bool = False,
    progress: Progress,
) -> dict:
    """One full-size layer of random weights of a named shape, on a synthetic trace fitted to
    the shape's published layer-mean rho(2) (or `reuse2`): the expert operation's fits,
    bandwidths, epsilon, u(n), r(n), the saving summed over the model's L MoE layers and
    its crossover. (No whole model exists, so no verify times or staircase.)"""
    from moespec.models import parse_dtype
    from moespec.routing.shapes import get_shape
    from moespec.routing.synthetic import LocalityProcess, synthetic_trace

    started = time.perf_counter()
    settings = settings or BenchSettings()
    shape = get_shape(shape_name)
    target = reuse2 if reuse2 is not None else shape.published_reuse2
    if target is None:
        raise ValueError(f"shape {shape_name} has no published rho(2); pass --reuse2")
    plan_path = out_dir / "plan.json"
    if plan_path.exists() and not force:
        raise FileExistsError(f"{plan_path} already exists (pass --force to overwrite it)")
    progress.start(f"making a synthetic trace with rho(2) = {target}")
    process = LocalityProcess(shape.num_experts, shape.top_k).fit(target)
    trace = synthetic_trace(
        process,
        num_layers=1,
        tokens=tokens,
        documents=20,
        expert_bytes=[shape.bytes_per_expert],
        model=shape.name,
        seed=settings.seed,
    )
    layer = 0
    progress.start(f"making one layer of {shape.name}'s experts")
    experts = random_experts(shape, parse_dtype(dtype), settings.seed, weights)
    expert_bytes = experts.bytes_per_expert
    windows_ids = windows_by_layer(trace, [layer], settings.pass_sizes, windows, settings.seed)
    records, kernels, dedup_kernel, fits, errors, bandwidths = bench_and_fit(
        {layer: experts},
        shape.top_k,
        settings,
        windows_ids,
        {"shape": shape.name, "dtype": dtype, **({"weights": weights} if weights else {})},
        out_dir,
        progress,
        force,
    )
    max_n = max(settings.pass_sizes)
    routing = estimate(document_statistics(trace, max_n), bootstrap=0)
    per_layer = times_from_fits(fits, routing.union, [expert_bytes], shape.top_k)
    for kernel in per_layer:  # a one-token pass runs the per-slot kernel whatever the switch
        per_layer[kernel][:, 0] = per_layer["slot"][:, 0]
    # Every MoE layer has the same expert shape and (synthetic) routing law: sum L of them.
    expert_saving = shape.num_layers * (per_layer["slot"][0] - per_layer[dedup_kernel][0])
    from moespec.costmodel import crossover

    plan = {
        "format": PLAN_FORMAT,
        "kind": "shape",
        "shape": asdict(shape),
        "dtype": dtype,
        "device": "cpu",
        "versions": {"moespec": moespec.__version__, "torch": torch.__version__},
        "threads": torch.get_num_threads(),
        "weights": weight_provenance(experts.format, experts.dtype, [expert_bytes]),
        "bench": {
            "settings": asdict(settings),
            "layers": [layer],
            "windows_per_pass": windows,
            "raw": "bench.jsonl",
        },
        "read_bandwidth": read_bandwidth(),
        "fits": fit_summary(fits, errors),
        "bandwidth_error": max(e for e in errors.values() if e is not None),
        "bandwidth": {
            k: {str(n): v for n, v in t.items()} for k, t in bandwidths["bandwidth"].items()
        },
        "bandwidth_ratio": {
            k: {str(n): v for n, v in t.items()} for k, t in bandwidths["bandwidth_ratio"].items()
        },
        "routing": {
            "process": process.metadata(),
            "tokens": tokens,
            "byte_share": routing.byte_share.tolist(),
            "reuse_mean": routing.reuse_mean.tolist(),
        },
        "expert_time": {k: (shape.num_layers * v[0]).tolist() for k, v in per_layer.items()},
        "expert_saving": expert_saving.tolist(),
        "kernel": {
            "crossover": crossover({n: s for n, s in enumerate(expert_saving, 1) if n >= 2}),
            "dedup_kernel": dedup_kernel,
        },
        "seconds": None,
    }
    plan["seconds"] = time.perf_counter() - started
    write_json(plan_path, plan, force=force)
    return plan
