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

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from moespec.calibrate.batch import BATCH_SIZES, batch_unions, predict_batch
from moespec.calibrate.bench import BenchSettings, ExpertOpBenchmark, random_experts
from moespec.calibrate.bytes import model_bytes
from moespec.calibrate.fits import LayerFits, SlotFit, effective_bandwidths
from moespec.calibrate.ids import recorded_windows
from moespec.calibrate.predict import (
    ACCEPTANCES,
    Prediction,
    outside_growth,
    times_from_fits,
    times_from_layer_fits,
    times_from_measurements,
    verify_times,
)
from moespec.calibrate.texts import (
    TRACE_TOKENS,
    VERIFY_MIN_REPEATS,
    VERIFY_REPEATS,
    VERIFY_SECONDS,
    VERIFY_TEXTS,
    VERIFY_WARMUP,
    check_verify_text,
    stdlib_documents,
    verify_documents,
    verify_text,
    verify_tokens,
)
from moespec.calibrate.timing import FLUSH_BYTES, last_level_cache_bytes, read_bandwidth
from moespec.calibrate.verify import (
    STREAM_PASSES,
    measure_draft_time,
    measure_verify,
    pass_span,
    verify_table,
)
from moespec.costmodel import crossover
from moespec.demo import describe
from moespec.errors import SettingError, setting
from moespec.files import OutputExistsError, output_directory
from moespec.kernels import ExpertWeights
from moespec.plan import (
    PLAN_FORMAT,
    BatchTable,
    BenchRun,
    Chain,
    FitSummary,
    KernelChoice,
    ModelRouting,
    ModelSignature,
    Plan,
    PredictionSummary,
    Provenance,
    ShapePlan,
    ShapeRouting,
    WeightFormats,
    load_plan,
    typed,
)
from moespec.progress import Progress, using
from moespec.provenance import provenance
from moespec.routing.reuse import (
    check_not_degenerate,
    document_statistics,
    estimate,
    split_trace,
)
from moespec.routing.trace import RoutingTrace

__all__ = [
    "PLAN_FORMAT",
    "load_plan",
    "make_plan",
    "make_shape_plan",
    "model_signature",
    "stdlib_documents",
    "verify_documents",
    "verify_text",
]


class Stages:
    """Seconds per stage of a plan's chain, in the order done (the plan's provenance)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def done(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = round(now - self._last, 3)
        self._last = now


def model_signature(config) -> dict:
    """What a plan must match to be used with a model."""
    return asdict(ModelSignature.of(config))


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


@dataclass
class Measured:
    """The expert-operation benchmark and its fits: raw records, the kernels timed (per-slot
    and one deduplicating), the fits (per layer and pooled), epsilon_p per kernel, β_p(n) and
    r(n)."""

    records: list[dict]
    kernels: list[str]
    dedup_kernel: str
    fits: LayerFits
    errors: dict
    bandwidths: dict

    @property
    def bandwidth_error(self) -> float:
        """epsilon (§4): the larger of the kernels' epsilon_p."""
        return self.fits.bandwidth_error(self.records)

    def fit_summaries(self) -> dict[str, FitSummary]:
        """The pooled fits, each with its own median error over all windows."""
        pooled = self.fits.pooled
        return fit_summary(pooled, {k: f.bandwidth_error(self.records) for k, f in pooled.items()})

    def layer_fit_summaries(self) -> dict[int, dict[str, FitSummary]]:
        """Each benchmarked layer's fits with its error on its own windows (empty: pooled)."""
        errors = self.fits.layer_errors(self.records)
        return {
            layer: fit_summary(fits, errors[layer]) for layer, fits in self.fits.by_layer.items()
        }

    def bandwidth_tables(self) -> dict:
        """{"bandwidth": {kernel: {n: β}}, "bandwidth_ratio": {kernel: {n: r}}}."""
        return {name: self.bandwidths[name] for name in ("bandwidth", "bandwidth_ratio")}


def bench_and_fit(
    experts,
    top_k,
    settings,
    windows_ids,
    header,
    out_dir,
    progress,
    force,
    per_layer=True,
    native: bool | None = None,
):
    """Benchmark the layers' expert operation (raw timings to out_dir/bench.jsonl, resumed
    after an interruption unless `force` restarts it; `native` as ExpertOpBenchmark's), fit
    each kernel (each layer on its own, or pooled), score the fits on the windows: a
    `Measured`."""
    raw = Path(out_dir) / "bench.jsonl"
    if force:
        raw.unlink(missing_ok=True)
    bench = ExpertOpBenchmark(experts, top_k, settings, windows_ids, header=header, native=native)
    records = bench.run(raw, progress=progress)
    return measured_from_records(records, top_k, settings.kernels, per_layer=per_layer)


def measured_from_records(records, top_k, kernels, per_layer=True) -> Measured:
    """The fits (each layer on its own, or pooled), epsilon_p and bandwidths of benchmark
    records: a `Measured`."""
    kernels = [k for k in kernels if k != "reference"]
    dedup_kernel = next(k for k in kernels if k != "slot")
    fits = LayerFits.fit(records, top_k, kernels, per_layer=per_layer)
    errors = fits.kernel_errors(records)
    bandwidths = effective_bandwidths(records, top_k)
    return Measured(records, kernels, dedup_kernel, fits, errors, bandwidths)


def fit_summary(fits: dict, errors: dict) -> dict[str, FitSummary]:
    out = {}
    for kernel, fit in fits.items():
        summary = FitSummary(
            coefficients=[float(c) for c in fit.coefficients_],
            fixed_time=fit.fixed_time_,
            bandwidth_error=errors[kernel],
            passes=fit.n_passes_,
        )
        if isinstance(fit, SlotFit):
            summary.first_read_cost = fit.first_read_cost_
            summary.reread_cost = fit.reread_cost_
            summary.reread_ratio = fit.reread_ratio_
        else:
            summary.union_cost, summary.token_cost = fit.union_cost_, fit.token_cost_
        out[kernel] = summary
    return out


def bench_run(settings: BenchSettings, layers: list[int], windows: int) -> BenchRun:
    return BenchRun(asdict(settings), list(layers), windows, "bench.jsonl")


def engine_cache_state(settings: BenchSettings, model) -> BenchSettings:
    """The settings with the cache flush resolved (`flush_bytes` None: decided here) to the
    state the engine's passes meet: a model whose weights fit in this CPU's last-level cache
    is read warm from it step after step, so its expert operation is timed warm (no flush; in
    a session check one demo target layer's dedup operation took about 6x longer flushed at
    n = 1); a larger model streams its weights from memory, so each timed run follows a
    flush, as seed 000 times it."""
    if settings.flush_bytes is not None:
        return settings
    parts = model.parameter_bytes()
    cache = last_level_cache_bytes()
    warm = cache is not None and parts["experts"] + parts["dense"] <= cache
    return replace(settings, flush_bytes=0 if warm else FLUSH_BYTES)


def refuse_existing(plan_path: Path, force: bool) -> None:
    if plan_path.exists() and not force:
        raise OutputExistsError(plan_path)


def make_plan(out_dir: Path, *, progress: Progress | bool = True, **options) -> Plan:
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
    verify_repeats: int = VERIFY_REPEATS,
    verify_seconds: float | None = VERIFY_SECONDS,
    verify_text_kind: str = VERIFY_TEXTS[0],
    per_layer_fits: bool = True,
    batch_sizes: tuple[int, ...] = BATCH_SIZES,
    trace_tokens: int | None = TRACE_TOKENS,
    force: bool = False,
    progress: Progress,
) -> Plan:
    """The chain of make_plan, in an existing out_dir: load the model, take its routing,
    benchmark and fit the expert operation, time whole-model passes and the draft, predict
    in three versions, choose one, write the plan. trace_tokens: tokens of routing recorded
    on the embedded corpus without a trace, spread evenly over its documents (None: all).
    verify_repeats, verify_seconds: the most whole-model verify rounds, and the seconds after
    which no more are added once VERIFY_MIN_REPEATS are timed (None: every round).
    verify_text_kind: what those passes and the draft's run on (`plan_text`)."""
    started = time.perf_counter()
    stages = Stages()
    settings = settings or BenchSettings()
    plan_path = out_dir / "plan.json"
    refuse_existing(plan_path, force)
    check_verify_text(verify_text_kind)
    model, tokenizer, layers = load_target(model_dir, dtype, weights, bench_layers, progress)
    settings = engine_cache_state(settings, model)
    stages.done("load")
    trace = routing_trace(model, tokenizer, trace_path, model_dir, progress, trace_tokens)
    stages.done("routing")
    windows_ids = windows_by_layer(trace, layers, settings.pass_sizes, windows, settings.seed)
    header = {
        "model": model.config.name,
        "dtype": dtype,
        **({"weights": weights} if weights else {}),
    }
    experts = {layer: model.moe_blocks[layer].experts for layer in layers}
    measured = bench_and_fit(
        experts,
        model.config.top_k,
        settings,
        windows_ids,
        header,
        out_dir,
        progress,
        force,
        per_layer=per_layer_fits,
        # the expert operation the engine runs: the native pass's where it takes the model
        native=model.native_step() is not None,
    )
    stages.done("bench")
    max_n = max(settings.pass_sizes)
    routing = trace_routing(trace, max_n)
    model.batch_invariant = settings.batch_invariant  # the whole-model passes alike
    text = plan_text(model, tokenizer, verify_text_kind, depth, max_n, progress)
    whole = measure_verify(
        model,
        text,
        depth=depth,
        pass_sizes=settings.pass_sizes,
        kernels=measured.kernels,
        repeats=verify_repeats,
        warmup=VERIFY_WARMUP,
        budget_seconds=verify_seconds,
        min_repeats=min(VERIFY_MIN_REPEATS, verify_repeats),
        progress=progress,
        mode="stream",  # as recorded in the provenance below
        passes=STREAM_PASSES,
    )
    whole_times = {k: np.array(verify_table(whole, k, max_n)) for k in measured.kernels}
    stages.done("verify")
    draft_time = draft_times(draft_dir, tokenizer, dtype, text, depth, max_n, progress)
    stages.done("draft")
    versions, chain = prediction_versions(model, routing, measured, whole_times, draft_time, max_n)
    chosen_name, chosen = choose_version(versions, measured, whole_times, draft_time)
    batch = batch_table(
        model, trace, measured, float(whole_times["slot"][0]), chain, chosen, batch_sizes, max_n
    )
    stages.done("predict")
    plan = Plan(
        model=ModelSignature.of(model.config),
        model_dir=describe(model_dir),
        draft_dir=describe(draft_dir) if draft_dir else None,
        dtype=dtype,
        provenance=plan_provenance(
            next(iter(experts.values())),
            {
                "trace": describe(trace_path) if trace_path else None,
                "trace_tokens": None if trace_path else trace_tokens,  # None: all
                "depth": depth,
                "verify_repeats": verify_repeats,  # the most rounds
                "verify_rounds": len(whole[0]["seconds"]),  # the rounds timed
                "verify_seconds": verify_seconds,  # the stage's budget (None: none)
                "verify_mode": "stream",
                "verify_text": verify_text_kind,
                "stream_passes": STREAM_PASSES,
                "stage_seconds": stages.seconds,  # where the plan's time went
            },
        ),
        bench=bench_run(settings, layers, windows),
        read_bandwidth=read_bandwidth(),
        fits=measured.fit_summaries(),
        bandwidth_error=measured.bandwidth_error,
        **measured.bandwidth_tables(),
        routing=ModelRouting(
            documents=trace.num_documents,
            tokens=trace.num_tokens,
            byte_share=routing.byte_share.tolist(),
            reuse_mean=routing.reuse_mean.tolist(),
            union=routing.union.tolist(),
        ),
        bytes=model_bytes(model, routing.union),
        measured_verify={k: v.tolist() for k, v in whole_times.items()},
        verify_records=whole,
        predictions={name: summary for name, (_, summary) in versions.items()},
        plan_version=chosen_name,
        kernel=KernelChoice(chosen.crossover(), measured.dedup_kernel),
        verify_time=chosen.auto_verify().tolist(),
        draft_time=draft_time.tolist(),
        step_times=chosen.step_times(),
        seconds=time.perf_counter() - started,
        chain=chain,
        fits_per_layer=measured.fits.per_layer,
        layer_fits=measured.layer_fit_summaries(),
        kernel_bandwidth_error=measured.errors,
        weights=weight_formats(
            model.expert_format,
            model.dense_format,
            [e.bytes_per_expert for e in experts.values()],
            model.dtype,
        ),
        batch=batch,
    )
    plan.save(plan_path, force=force)
    return plan


def batch_table(
    model, trace, measured, plain_time: float, chain, chosen, batch_sizes, max_n: int
) -> BatchTable | None:
    """k*(a, B) from the fits at the union of B sequences' windows (`calibrate.batch`);
    None without batch sizes beyond one. Its row at B = 1 is the plan's own tau(n), so the
    table's k*(a, 1) is the staircase's."""
    if not batch_sizes or max(batch_sizes) < 2:
        return None
    fit_trace = split_trace(trace, "fit") if trace.num_documents > 1 else trace
    unions = batch_unions(fit_trace, batch_sizes, max_n)
    layers = list(model.moe_blocks)
    prediction = predict_batch(
        measured.fits,
        layers,
        [model.moe_blocks[layer].experts.bytes_per_expert for layer in layers],
        model.config.top_k,
        unions,
        plain_time,
        chain.outside_growth,
        chosen.crossover(),
    )
    if 1 in prediction.verify_time:
        prediction.verify_time[1] = chosen.auto_verify().tolist()
        prediction.kernel[1] = [chosen.kernel_for(n) for n in range(1, max_n + 1)]
    return BatchTable(
        batch_sizes=prediction.batch_sizes,
        verify_time=prediction.verify_time,
        kernel=prediction.kernel,
        union=prediction.union,
        growth_slope=prediction.growth_slope,
        best_draft_length=prediction.best_draft_lengths(ACCEPTANCES),
    )


def load_target(model_dir, dtype: str, weights: str | None, bench_layers, progress: Progress):
    """The checkpoint (its weights in `weights`: `models.load_model`), its tokenizer and the
    MoE layers to benchmark (all of up to 4, else the first and the middle one)."""
    from moespec.models import load_model

    progress.start(f"loading {model_dir}")
    model, tokenizer = load_model(model_dir, dtype=dtype, weights=weights)
    if not model.config.is_moe:
        raise ValueError(f"{model_dir} is not an MoE model: there is no expert operation to plan")
    moe_layers = list(model.moe_blocks)
    layers = bench_layers or (
        moe_layers if len(moe_layers) <= 4 else [moe_layers[0], moe_layers[len(moe_layers) // 2]]
    )
    unknown = [layer for layer in layers if layer not in moe_layers]
    if unknown:
        raise ValueError(f"layers {unknown} are not MoE layers of {model_dir} ({moe_layers})")
    return model, tokenizer, layers


def routing_trace(
    model, tokenizer, trace_path, model_dir, progress: Progress, trace_tokens=TRACE_TOKENS
) -> RoutingTrace:
    """The model's routing: the given trace (checked to be this model's), else recorded on
    the embedded corpus (`trace_tokens` of it, spread evenly over its documents; None: all
    of it); refused when degenerate."""
    from moespec.routing.record import record_trace

    if trace_path is not None:
        from moespec.routing.store import read_trace

        trace = read_trace(trace_path)
        same_layers = list(trace.layer_indices) == list(model.moe_blocks)
        if trace.num_experts != model.config.num_experts or not same_layers:
            raise ValueError(f"{trace_path} was not recorded from this model's routing")
    else:
        # the embedded corpus's longer files are cut to the model's context
        progress.start("recording routing on the embedded corpus")
        documents = list(stdlib_documents())
        per_document = None if trace_tokens is None else max(1, trace_tokens // len(documents))
        trace = record_trace(
            model, tokenizer, documents, per_document=per_document, truncate="right"
        )
    check_not_degenerate(trace, str(trace_path or model_dir))
    return trace


def plan_text(model, tokenizer, kind: str, depth: int, max_n: int, progress) -> list[int]:
    """The tokens a plan's whole-model verify passes run on (`texts.verify_tokens`), up to the
    last stream pass of max_n tokens at `depth`."""
    first, end = pass_span(depth, max_n, "stream", STREAM_PASSES)
    return verify_tokens(model, tokenizer, kind, first, end, progress)


def draft_times(draft_dir, tokenizer, dtype, text, depth, max_n, progress) -> np.ndarray:
    """h(k), k = 0..max_n - 1, of the draft at draft_dir (zeros without one)."""
    from moespec.models import load_model

    if draft_dir is None:
        return np.zeros(max_n)
    progress.start(f"measuring the draft's step times h(k) ({draft_dir})")
    draft, draft_tokenizer = load_model(draft_dir, dtype=dtype)
    if not tokenizer.same_vocabulary(draft_tokenizer):
        raise ValueError(f"the draft at {draft_dir} has a different tokenizer vocabulary")
    return np.array(measure_draft_time(draft, text, depth=depth, max_draft_length=max_n - 1))


def trace_routing(trace: RoutingTrace, max_n: int):
    """ρ̄(n), U_l(n), ū(n) of the trace's fit documents (no bootstrap)."""
    fit_trace = split_trace(trace, "fit") if trace.num_documents > 1 else trace
    return estimate(document_statistics(fit_trace, max_n), bootstrap=0)


def prediction_versions(model, routing, measured: Measured, whole_times, draft_time, max_n):
    """{version: (Prediction, PredictionSummary)} and the `Chain` behind them: from each
    layer's fit at its U_l(n), from the timed windows, and those plus the growth outside the
    expert operation (calibrated)."""
    moe_layers = list(model.moe_blocks)
    expert_bytes = [model.moe_blocks[layer].experts.bytes_per_expert for layer in moe_layers]
    fitted = times_from_layer_fits(measured.fits, moe_layers, routing.union, expert_bytes)
    timed = times_from_measurements(measured.records, moe_layers, max_n)
    plain = float(whole_times["slot"][0])
    ratio = measured.bandwidths["bandwidth_ratio"].get(measured.dedup_kernel, {})
    versions = {}
    growth = outside_growth(whole_times["slot"], timed)
    inputs = {
        "prediction": (fitted, None),
        "measured_time": (timed, None),
        "calibrated": (timed, growth),
    }
    for name, (times, growth_n) in inputs.items():
        prediction = Prediction(
            verify=verify_times(plain, times, growth_n),
            expert_time={k: v.sum(axis=0) for k, v in times.items()},
            bandwidth_error=measured.bandwidth_error,
            draft_time=draft_time,
            dedup_kernel=measured.dedup_kernel,
        )
        summary = typed(PredictionSummary, prediction.to_dict(routing.byte_share, ratio))
        versions[name] = (prediction, summary)
    chain = Chain(
        layers=moe_layers,
        layer_times={
            name: {k: v.tolist() for k, v in times.items()} for name, (times, _) in inputs.items()
        },
        outside_growth=growth.tolist(),
    )
    return versions, chain


def choose_version(versions, measured: Measured, whole_times, draft_time):
    """The calibrated version, or the whole-model measurement itself when a calibrated step
    time is not positive: (name, Prediction)."""
    chosen = versions["calibrated"][0]
    if chosen.valid():
        return "calibrated", chosen
    return "measured", Prediction(
        verify=whole_times,
        expert_time=chosen.expert_time,
        bandwidth_error=measured.bandwidth_error,
        draft_time=draft_time,
        dedup_kernel=measured.dedup_kernel,
    )


def plan_provenance(experts: ExpertWeights, settings: dict) -> Provenance:
    """Where the benchmark ran (the device of the experts it timed; packed: the CPU's), on
    what, from which commit, with which settings of the chain."""
    return Provenance(**provenance(experts.device, settings))


def weight_formats(
    expert_format, dense_format, expert_bytes: list[int], activations=None
) -> WeightFormats:
    """The plan's weight formats and product paths (`moespec.kernels.cpu`), with w_l as held
    and the byte factor f_l (seed 000 Table 6): both kernels read each expert's held bytes
    (int8 values and scales, or the dtype's) once per read, so f_l = 1 in either format."""
    from moespec.kernels.cpu import weight_paths

    paths = weight_paths(expert_format, dense_format, activations)
    del paths["cpu"]  # the provenance records the CPU
    return WeightFormats(**paths, expert_bytes=list(expert_bytes), byte_factor=1.0)


def shape_experts(shape, dtype: str, weights: str | None, seed: int, device="cpu"):
    """One layer of random experts of the shape on `device`, held as a loaded model holds
    them: int8 (values and per-channel scales) for an int8 format, else in `dtype` (packed
    on the CPU). int8 experts are a CPU format."""
    from moespec.models import INT8_FORMATS, check_weights, parse_dtype

    check_weights(weights, parse_dtype(dtype))
    on_cpu = torch.device(device).type == "cpu"
    if weights in INT8_FORMATS:
        if not on_cpu:
            raise SettingError(f"int8 experts run on the CPU only, not on {device}")
        return random_experts(shape, parse_dtype(dtype), seed, pack=False).quantize_int8()
    return random_experts(shape, parse_dtype(dtype), seed, device=device, pack=on_cpu)


def make_shape_plan(out_dir: Path, *, progress: Progress | bool = True, **options) -> ShapePlan:
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
    device: str = "cpu",
    force: bool = False,
    progress: Progress,
) -> ShapePlan:
    """One full-size layer of random weights of a named shape, on a synthetic trace fitted to
    the shape's published layer-mean rho(2) (or `reuse2`): the expert operation's fits,
    bandwidths, epsilon, u(n), r(n), the saving summed over the model's L MoE layers and
    its crossover, all measured on `device` ("cpu", or a CUDA device: the same benchmark
    and fits on a GPU's kernels, timed by CUDA events). (No whole model exists, so no verify
    times or staircase.)"""
    from moespec.routing.shapes import get_shape

    started = time.perf_counter()
    settings = settings or BenchSettings()
    if settings.flush_bytes is None:  # a model of full-size shapes streams from memory
        settings = replace(settings, flush_bytes=FLUSH_BYTES)
    shape = get_shape(shape_name)
    target = reuse2 if reuse2 is not None else shape.published_reuse2
    if target is None:
        raise SettingError(f"shape {shape_name} has no published rho(2); pass {setting('reuse2')}")
    refuse_existing(out_dir / "plan.json", force)
    process, trace = shape_trace(shape, target, tokens, settings.seed, progress)
    layer = 0
    progress.start(f"making one layer of {shape.name}'s experts")
    experts = shape_experts(shape, dtype, weights, settings.seed, device)
    windows_ids = windows_by_layer(trace, [layer], settings.pass_sizes, windows, settings.seed)
    header = {"shape": shape.name, "dtype": dtype, **({"weights": weights} if weights else {})}
    measured = bench_and_fit(
        {layer: experts}, shape.top_k, settings, windows_ids, header, out_dir, progress, force
    )
    routing = estimate(document_statistics(trace, max(settings.pass_sizes)), bootstrap=0)
    expert_time = shape_expert_time(shape, measured, routing.union, experts.bytes_per_expert)
    expert_saving = expert_time["slot"] - expert_time[measured.dedup_kernel]
    plan = ShapePlan(
        shape=asdict(shape),
        dtype=dtype,
        provenance=plan_provenance(experts, {"reuse2": target, "tokens": tokens}),
        bench=bench_run(settings, [layer], windows),
        read_bandwidth=read_bandwidth(device=experts.device),
        fits=measured.fit_summaries(),
        bandwidth_error=measured.bandwidth_error,
        **measured.bandwidth_tables(),
        routing=ShapeRouting(
            process=process.metadata(),
            tokens=tokens,
            byte_share=routing.byte_share.tolist(),
            reuse_mean=routing.reuse_mean.tolist(),
        ),
        expert_time={k: v.tolist() for k, v in expert_time.items()},
        expert_saving=expert_saving.tolist(),
        kernel=KernelChoice(
            crossover({n: s for n, s in enumerate(expert_saving, 1) if n >= 2}),
            measured.dedup_kernel,
        ),
        seconds=time.perf_counter() - started,
        weights=weight_formats(
            experts.format, experts.dtype, [experts.bytes_per_expert], experts.dtype
        ),
    )
    plan.save(out_dir / "plan.json", force=force)
    return plan


def shape_trace(shape, reuse2: float, tokens: int, seed: int, progress: Progress):
    """A synthetic one-layer trace of the shape fitted to layer-mean rho(2) = reuse2."""
    from moespec.routing.synthetic import LocalityProcess, synthetic_trace

    progress.start(f"making a synthetic trace with rho(2) = {reuse2}")
    process = LocalityProcess(shape.num_experts, shape.top_k).fit(reuse2)
    trace = synthetic_trace(
        process,
        num_layers=1,
        tokens=tokens,
        documents=20,
        expert_bytes=[shape.bytes_per_expert],
        model=shape.name,
        seed=seed,
    )
    return process, trace


def shape_expert_time(shape, measured: Measured, union, expert_bytes: int) -> dict:
    """{kernel: [n_max]} the expert operation's time from the fits at w_l = expert_bytes (as
    held: int8 values and scales, or the dtype's), summed over the model's L MoE layers
    (every one has the same expert shape and synthetic routing law)."""
    per_layer = times_from_fits(measured.fits.pooled, union, [expert_bytes], shape.top_k)
    for kernel in per_layer:  # a one-token pass runs the per-slot kernel whatever the switch
        per_layer[kernel][:, 0] = per_layer["slot"][:, 0]
    return {k: shape.num_layers * v[0] for k, v in per_layer.items()}
