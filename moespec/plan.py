"""The plan: what calibration measured and decided, as typed objects with a JSON schema.

`Plan` (schema "moespec-plan/2") is a checkpoint's plan: fits, bandwidths β_p(n) and r(n),
the three prediction versions, the crossover the engine switches kernels at and the verify
times V(k) the draft-length policy reads. `ShapePlan` ("moespec-shape-plan/2") is one
full-size layer of random weights of a named shape: fits, bandwidths and the expert
operation's crossover, no whole model. `moespec.calibrate` writes both; `moespec.decoding`
reads a `Plan`, which builds its kernel policy and draft policy itself.

Files of schema "moespec-plan/1" (both kinds under one tag, told apart by "kind": "shape")
are read and lifted to /2: their device, threads and versions become the provenance.
Any other schema, a missing or unknown key, or a value of the wrong type is one line.
"""

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PLAN_FORMAT = "moespec-plan/2"
SHAPE_PLAN_FORMAT = "moespec-shape-plan/2"
LEGACY_FORMAT = "moespec-plan/1"


@dataclass
class ModelSignature:
    """What a plan must match to be used with a model (the name is informative only)."""

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int

    @classmethod
    def of(cls, config) -> "ModelSignature":
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


@dataclass
class Provenance:
    """Where and how a result was made (`moespec.provenance.provenance`)."""

    device: str
    threads: int
    versions: dict[str, str]
    machine: dict[str, Any] | None = None
    cpu_capability: str | None = None
    commit: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class WeightFormats:
    """The weight formats a plan ran with and the product path each took here
    (`moespec.kernels.cpu.weight_paths`; the CPU behind them is the provenance's), with w_l
    as held per benchmarked layer and the byte factor f_l (seed 000 Table 6)."""

    experts: str | None
    dense: str
    expert_path: str | None
    dense_path: str
    expert_bytes: list[int]
    byte_factor: float = 1.0


@dataclass
class BenchRun:
    """The expert-operation benchmark behind the fits (raw samples in `raw`)."""

    settings: dict[str, Any]
    layers: list[int]
    windows_per_pass: int
    raw: str


@dataclass
class FitSummary:
    """One kernel's fit: eq. (4) per-slot (first read, re-read) or (E.1) deduplicating."""

    coefficients: list[float]
    fixed_time: float
    bandwidth_error: float | None
    passes: int
    first_read_cost: float | None = None
    reread_cost: float | None = None
    reread_ratio: float | None = None
    union_cost: float | None = None
    token_cost: float | None = None


@dataclass
class KernelChoice:
    """Per-slot below `crossover`, `dedup_kernel` from it (None: per-slot at every n)."""

    crossover: int | None
    dedup_kernel: str


@dataclass
class StaircaseEntry:
    best_draft_length: int
    speedup: float
    certain: bool | None = None


@dataclass
class Staircase:
    """k̂*(a) on V̂(k), its step points and the bounds (20)-(21); `error` when V̂ is invalid."""

    step_times: list[float]
    step_points: list[float] = field(default_factory=list)
    by_acceptance: dict[str, StaircaseEntry] = field(default_factory=dict)
    step_time_error: float | None = None
    throughput_loss_bound: float | None = None
    speedup_bounds: list[float] | None = None
    error: str | None = None


@dataclass
class PredictionSummary:
    """One version of the prediction chain (`calibrate.predict.Prediction.to_dict`)."""

    verify_time: dict[str, list[float]]
    expert_time: dict[str, list[float]]
    saving: list[float]
    saving_bound: list[float] | None
    crossover: int | None
    draft_time: list[float]
    staircase: Staircase
    kernel_choice_robust: dict[int, bool] | None = None


@dataclass
class ModelRouting:
    """The fit documents' routing statistics: ū(n), ρ̄(n) and U_l(n)."""

    documents: int
    tokens: int
    byte_share: list[float]
    reuse_mean: list[float]
    union: list[list[float]]


@dataclass
class ShapeRouting:
    """The synthetic process a shape plan was benchmarked on, and its ū(n), ρ̄(n)."""

    process: dict[str, Any]
    tokens: int
    byte_share: list[float]
    reuse_mean: list[float]


@dataclass
class Chain:
    """The chain's per-layer inputs: t_p,l(n) of each version ([L][n_max] per kernel, rows
    in `layers` order) and g(n); with them the chain re-anchors on another run's tau_meas(1)
    (`calibrate.predict.anchored_predictions`)."""

    layers: list[int]
    layer_times: dict[str, dict[str, list[list[float]]]]
    outside_growth: list[float]


@dataclass
class BatchTable:
    """The draft length per batch size (`moespec.calibrate.batch`): tau_hat_B(k) of a pass of
    B sequences of k + 1 tokens each, predicted at the union of their experts, and k*(a, B)
    on each sequence's share V_B(k) = tau_hat_B(k) / B for a drafter that proposes at no cost."""

    batch_sizes: list[int]
    verify_time: dict[int, list[float]]  # B -> tau_hat_B(k), k = 0..k_max
    kernel: dict[int, list[str]]  # B -> the kernel of each pass
    union: dict[int, list[float]]  # B -> U^B(k + 1), summed over the MoE layers
    growth_slope: float  # seconds per token outside the experts beyond the measured sizes
    best_draft_length: dict[str, dict[int, int]]  # acceptance -> B -> k*(a, B)

    def verify_times(self, batch: int) -> list[float] | None:
        """tau_hat_B(k) at batch size `batch`: the table's own, else interpolated linearly in
        B between the nearest sizes it holds (None beyond its largest)."""
        sizes = sorted(self.batch_sizes)
        if batch in self.verify_time:
            return list(self.verify_time[batch])
        if batch < sizes[0] or batch > sizes[-1]:
            return None
        high = next(b for b in sizes if b > batch)
        low = max(b for b in sizes if b < batch)
        share = (batch - low) / (high - low)
        return [
            (1 - share) * a + share * b
            for a, b in zip(self.verify_time[low], self.verify_time[high], strict=True)
        ]


@dataclass
class Plan:
    """A checkpoint's plan (schema moespec-plan/2)."""

    model: ModelSignature
    model_dir: str
    draft_dir: str | None
    dtype: str
    provenance: Provenance
    bench: BenchRun
    read_bandwidth: float
    fits: dict[str, FitSummary]
    bandwidth_error: float
    bandwidth: dict[str, dict[int, float]]  # β_p(n), bytes/s, per kernel
    bandwidth_ratio: dict[str, dict[int, float]]  # r(n) per deduplicating kernel
    routing: ModelRouting
    measured_verify: dict[str, list[float]]
    verify_records: list[dict[str, Any]]
    predictions: dict[str, PredictionSummary]
    plan_version: str
    kernel: KernelChoice
    verify_time: list[float]  # τ(n) of the chosen kernel, n = 1..n_max
    draft_time: list[float]  # h(k), k = 0..n_max - 1
    step_times: list[float]  # V(k) = τ(k + 1) + h(k)
    seconds: float
    chain: Chain | None = None  # absent in plans made before the chain was kept
    # bytes per pass split as seed 000 eq. (5) does (`calibrate.bytes.model_bytes`)
    bytes: dict[str, Any] | None = None
    fits_per_layer: bool = False  # each benchmarked layer fitted on its own (seed 000)
    layer_fits: dict[int, dict[str, FitSummary]] = field(default_factory=dict)
    kernel_bandwidth_error: dict[str, float | None] = field(default_factory=dict)  # eps_p
    weights: WeightFormats | None = None  # absent in plans made before int8 weights
    batch: BatchTable | None = None  # absent in plans made before batched decoding
    format: str = PLAN_FORMAT

    def check(self, where: str) -> None:
        """The values the engine relies on are sane (one-line ValueError otherwise)."""
        if not self.verify_time or any(t <= 0 for t in self.verify_time):
            raise ValueError(f"{where}: verify_time must be a list of positive seconds")
        if self.batch is not None:
            table = self.batch
            if not table.batch_sizes or any(b < 1 for b in table.batch_sizes):
                raise ValueError(f"{where}: batch.batch_sizes must be batch sizes >= 1")
            if set(table.verify_time) != set(table.batch_sizes):
                raise ValueError(f"{where}: batch.verify_time must hold one row per batch size")
            widths = {len(v) for v in table.verify_time.values()}
            if len(widths) != 1 or any(t <= 0 for v in table.verify_time.values() for t in v):
                raise ValueError(
                    f"{where}: batch.verify_time must be rows of positive seconds, one length"
                )
        crossover = self.kernel.crossover
        if crossover is not None and crossover < 1:
            raise ValueError(f"{where}: kernel.crossover must be a pass size >= 1 or null")

    def check_model(self, config, where: str) -> None:
        """Refuse a plan made for another model (layers, experts, top-k, shapes)."""
        expected = ModelSignature.of(config)
        for name in (f.name for f in dataclasses.fields(ModelSignature)):
            there, here = getattr(self.model, name), getattr(expected, name)
            if name != "name" and there != here:
                raise ValueError(
                    f"{where} was made for another model: {name} is {there!r} there and "
                    f"{here!r} here"
                )

    def kernel_policy(self, kernel: str = "auto", crossover: int | None = None):
        """The engine's kernel policy: `kernel` switched at `crossover`, else at the plan's."""
        from moespec.decoding.kernel_policy import KernelPolicy

        return KernelPolicy(kernel, self.kernel.crossover if crossover is None else crossover)

    def measured_draft(self, draft_dir) -> bool:
        """Whether this plan's draft times h(k) are those of the draft at `draft_dir`."""
        from moespec.demo import describe

        if self.draft_dir is None or draft_dir is None:
            return False
        return (
            describe(draft_dir) == self.draft_dir
            or Path(draft_dir).resolve() == Path(self.draft_dir).resolve()
        )

    def draft_policy(
        self, draft_dir=None, draft_length="auto", max_draft_length=8, measured_verify=None
    ):
        """The draft-length policy on the plan's verify times τ(n), with h(k) when the plan
        measured this very draft (else measured online)."""
        from moespec.decoding.draft_policy import DraftLengthPolicy

        return DraftLengthPolicy(
            draft_length,
            max_draft_length=max_draft_length,
            verify_times=self.verify_time,
            draft_times=self.draft_time if self.measured_draft(draft_dir) else None,
            measured_verify=measured_verify,
            batch_verify_times=None if self.batch is None else self.batch.verify_times,
        )

    def weights_kind(self) -> str:
        """The weights kind the plan ran with, as `--weights` names it."""
        formats = self.weights
        if formats is None:  # made before int8 weights: the dtype's own
            return self.dtype
        return weights_kind(formats.experts, formats.dense, self.dtype)

    def facts(self) -> dict:
        """What the plan's times depend on, as recorded: model, weights kind, engine, machine
        (`mismatch` compares them with `facts_here`)."""
        machine = self.provenance.machine
        return {
            "model": {k: v for k, v in vars(self.model).items() if k != "name"},
            "weights": self.weights_kind(),
            "engine": {k: self.provenance.versions.get(k) for k in ("moespec", "torch")},
            "machine": machine_key(machine) if machine else None,
        }

    def to_dict(self) -> dict:
        return _plain(self)

    def save(self, path, *, force: bool = False) -> Path:
        from moespec.files import write_json

        return write_json(path, self.to_dict(), force=force)


@dataclass
class ShapePlan:
    """One full-size layer of a named shape (schema moespec-shape-plan/2)."""

    shape: dict[str, Any]  # the named shape's dimensions (`routing.shapes.ModelShape`)
    dtype: str
    provenance: Provenance
    bench: BenchRun
    read_bandwidth: float
    fits: dict[str, FitSummary]
    bandwidth_error: float
    bandwidth: dict[str, dict[int, float]]
    bandwidth_ratio: dict[str, dict[int, float]]
    routing: ShapeRouting
    expert_time: dict[str, list[float]]  # the expert operation summed over the L layers
    expert_saving: list[float]
    kernel: KernelChoice
    seconds: float
    weights: WeightFormats | None = None
    format: str = SHAPE_PLAN_FORMAT

    def to_dict(self) -> dict:
        return _plain(self)

    def save(self, path, *, force: bool = False) -> Path:
        from moespec.files import write_json

        return write_json(path, self.to_dict(), force=force)


KINDS = {PLAN_FORMAT: Plan, SHAPE_PLAN_FORMAT: ShapePlan}


def plan_from_dict(data, where: str = "plan") -> Plan | ShapePlan:
    """A Plan or ShapePlan from its JSON object (schema /2, or /1 lifted to /2)."""
    if not isinstance(data, dict):
        raise ValueError(f"{where} is not a moespec plan (a JSON object of {PLAN_FORMAT})")
    data = _lift_legacy(data) if data.get("format") == LEGACY_FORMAT else data
    kind = KINDS.get(data.get("format"))
    if kind is None:
        raise ValueError(
            f"{where} is not a moespec plan (format {data.get('format')!r}; this moespec "
            f"reads {PLAN_FORMAT}, {SHAPE_PLAN_FORMAT} and {LEGACY_FORMAT})"
        )
    return _build(kind, data, where, "")


def read_plan_json(path):
    """The JSON of a plan file (of any engine), or one line saying why not."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such plan file") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None


def read_plan(path) -> Plan | ShapePlan:
    """A plan file of either kind."""
    return plan_from_dict(read_plan_json(path), str(path))


def load_plan(path, config=None, *, model=None) -> Plan:
    """A checkpoint's plan file, validated; with a model config, checked to be its plan; with
    the loaded model, also checked to be timed on its weights kind, with this engine's
    versions and on this machine (`PlanMismatch` says which differs): the one reading of a
    plan that `generate`, `serve` and `auto` decide from."""
    plan = read_plan(path)
    if isinstance(plan, ShapePlan):
        raise ValueError(
            f"{path} is a shape plan ({SHAPE_PLAN_FORMAT}): it has no verify times for a model"
        )
    plan.check(str(path))
    if model is not None:
        config = model.config
    if config is not None:
        plan.check_model(config, str(path))
    if model is not None:
        reason = mismatch(plan.facts(), facts_here(model))
        if reason is not None:
            raise PlanMismatch(
                f"{path} was timed for {reason}: its times are another clock's; make a plan "
                "here with `moespec plan`"
            )
    return plan


class PlanMismatch(ValueError):
    """A plan timed for another weights kind, engine version or machine."""


def weights_kind(experts: str | None, dense: str | None, dtype: str) -> str:
    """The weights kind as `--weights` names it: int8, int8-experts, or the dtype's name."""
    if experts == "int8":
        return "int8" if dense == "int8" else "int8-experts"
    return dtype


def machine_key(machine: dict) -> dict:
    """What of a machine decides the times: its CPU and cores (the platform string moves
    with kernel builds)."""
    return {"cpu": machine.get("cpu"), "cores": machine.get("cpu_count")}


def facts_here(model=None) -> dict:
    """This machine and moespec's versions, and with a loaded model its signature and
    weights kind (the facts `Plan.facts` records)."""
    import torch

    import moespec
    from moespec.provenance import machine

    here = {
        "engine": {"moespec": moespec.__version__, "torch": torch.__version__},
        "machine": machine_key(machine()),
    }
    if model is not None:
        from moespec.kernels.cpu import format_name

        signature = ModelSignature.of(model.config)
        here["model"] = {k: v for k, v in vars(signature).items() if k != "name"}
        here["weights"] = weights_kind(
            model.expert_format, model.dense_format, format_name(model.dtype)
        )
    return here


def mismatch(facts: dict, here: dict) -> str | None:
    """Why a plan's facts are not those here (the first that differs), or None. `here`
    holds what is known here: model (a signature's fields), weights, engine, machine; a fact
    missing on either side is not compared."""
    for name, noun in (("model", "model"), ("weights", "weights kind"), ("engine", "engine")):
        there, ours = facts.get(name), here.get(name)
        if there is None or ours is None:
            continue
        if isinstance(there, dict):
            for key, value in there.items():
                if value is not None and ours.get(key) is not None and ours[key] != value:
                    return f"another {noun}: {key} is {value!r} there and {ours[key]!r} here"
        elif there != ours:
            return f"another {noun}: {there!r} there and {ours!r} here"
    there, ours = facts.get("machine"), here.get("machine")
    if there is not None and ours is not None and there != ours:
        return (
            f"another machine: {there['cpu']!r} with {there['cores']} cores there and "
            f"{ours['cpu']!r} with {ours['cores']} here"
        )
    return None


def _lift_legacy(data: dict) -> dict:
    """A moespec-plan/1 object in the /2 layout (its provenance from the old top keys)."""
    data = dict(data)
    shape = data.pop("kind", None) == "shape"
    data["format"] = SHAPE_PLAN_FORMAT if shape else PLAN_FORMAT
    data["provenance"] = {
        key: data.pop(key) for key in ("device", "threads", "versions") if key in data
    }
    return data


def _plain(value):
    """JSON-ready: dataclasses as objects, int keys as strings (as json.dumps writes them)."""
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _build(cls, data, where: str, at: str):
    """An instance of dataclass `cls` from a JSON object, every field checked by its type."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: {at or 'the plan'} must be an object")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where}: unknown key {_join(at, unknown[0])!r} (schema {cls.__name__})")
    values = {}
    for f in dataclasses.fields(cls):
        key = _join(at, f.name)
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f"{where} has no {key!r}: not a complete plan")
            continue
        values[f.name] = _convert(hints[f.name], data[f.name], where, key)
    return cls(**values)


def _convert(hint, value, where: str, at: str):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        (hint,) = [a for a in args if a is not type(None)]
        return _convert(hint, value, where, at)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where, at)
    if origin is dict:
        key_type, value_type = args
        if not isinstance(value, dict):
            raise ValueError(f"{where}: {at} must be an object")
        return {
            _key(key_type, k, where, at): _convert(value_type, v, where, _join(at, str(k)))
            for k, v in value.items()
        }
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{where}: {at} must be a list")
        return [_convert(args[0], v, where, f"{at}[{i}]") for i, v in enumerate(value)]
    expected = {float: (int, float), int: (int,), str: (str,), bool: (bool,)}.get(hint)
    if expected and (
        not isinstance(value, expected) or (hint is not bool and isinstance(value, bool))
    ):
        raise ValueError(f"{where}: {at} must be of type {hint.__name__}, got {value!r}")
    return float(value) if hint is float else value


def _key(key_type, key: str, where: str, at: str):
    if key_type is int:
        try:
            return int(key)
        except ValueError:
            raise ValueError(f"{where}: {at} has a key {key!r} that is not a pass size") from None
    return key


def _join(at: str, name: str) -> str:
    return f"{at}.{name}" if at else name


def typed(cls, data: dict, where: str = "plan"):
    """An instance of one of the plan's dataclasses from its JSON object."""
    return _build(cls, data, where, "")
