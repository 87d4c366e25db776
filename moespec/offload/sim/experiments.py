"""The simulations behind the report: seed 003 Table 1, Table 2 and Figure 5, and sweeps.

Every function returns plain data (lists of dicts from `SimulationResult.to_dict`), so the CLI,
the benchmark and the report consume the same numbers. `progress(label)` is called before each
simulation (for a progress bar); every simulation replays the same workload with a fresh policy.
"""

from dataclasses import dataclass, replace

from moespec.errors import SettingError, setting
from moespec.offload import ABLATIONS, make_policy
from moespec.offload.sim.simulator import SimulationSettings, simulate

# Seed 003 Appendix A.1 reports these acceptances: CNN/DM, MT-Bench, GSM8K, HumanEval.
PAPER_ACCEPTANCES = {"cnn-dm": 0.56, "mt-bench": 0.68, "gsm8k": 0.83, "humaneval": 0.85}
CACHE_RATIOS = [0.1, 0.17, 0.25, 0.4, 0.6]
DRAFT_LENGTHS = [1, 2, 4, 8]


def settings_for(workload, **fields) -> SimulationSettings:
    """Simulation settings that carry the workload's fit split, dense bytes and hidden size."""
    return SimulationSettings(
        fit_tokens=workload.fit_tokens,
        dense_bytes_per_layer=workload.dense_bytes_per_layer,
        hidden_size=workload.hidden_size,
        **fields,
    )


def run_policy(workload, name: str, profile, settings: SimulationSettings) -> dict:
    policy = make_policy(name).fit(workload.fit_trace())
    return simulate(workload.trace, policy, profile, settings).to_dict()


def compare_policies(workload, names, profile, settings, progress=None) -> dict[str, dict]:
    """One result per policy, keyed by name (the CLI's --json object)."""
    out = {}
    for name in names:
        if progress:
            progress(name)
        out[name] = run_policy(workload, name, profile, settings)
    return out


def workload_table(workload, names, profile, settings, acceptances=None, progress=None):
    """Table 1 analogue: policies x workloads, a workload being an acceptance rate (the paper's
    benchmarks differ, to the scheduler, mostly by their acceptance; App. A.1)."""
    acceptances = acceptances or PAPER_ACCEPTANCES
    rows = []
    for label, a in acceptances.items():
        for name in names:
            if progress:
                progress(f"{name} @ {label}")
            result = run_policy(workload, name, profile, replace(settings, acceptance=a))
            rows.append({"workload": label, "acceptance": a, **result})
    return rows


def ablation_table(workload, profile, settings, progress=None) -> list[dict]:
    """Table 2 analogue: SpAc with one component removed at a time."""
    rows = []
    for name in ABLATIONS:
        if progress:
            progress(name)
        rows.append(run_policy(workload, name, profile, settings))
    return rows


def sweep(workload, names, profile, settings, field: str, values, progress=None) -> list[dict]:
    """Every policy at every value of one settings field (cache_ratio, draft_length, ...)."""
    rows = []
    for value in values:
        for name in names:
            if progress:
                progress(f"{name} @ {field}={value}")
            result = run_policy(workload, name, profile, replace(settings, **{field: value}))
            rows.append({field: value, **result})
    return rows


def load_workload(
    trace=None,
    synthetic: str | None = None,
    *,
    tokens: int = 2048,
    fit_tokens: int = 512,
    fit_documents: int = 1,
    draft_length: int = 8,
    reuse2: float | None = None,
    local_popularity: float = 0.0,
    seed: int = 0,
):
    """A recorded trace's workload, or a synthetic one of a built-in shape long enough for
    `tokens` tokens of speculative steps of `draft_length` (one replayed document after
    `fit_documents` fit documents, each popularity the share `local_popularity` its own:
    routing.synthetic)."""
    from moespec.offload.sim.workload import synthetic_workload, trace_workload

    if trace is not None:
        return trace_workload(trace)
    if tokens < 1 or fit_tokens < 1:
        raise SettingError(f"{setting('tokens')} and {setting('fit_tokens')} must be >= 1")
    if not 1 <= fit_documents <= fit_tokens:
        raise SettingError(
            f"{setting('fit_documents')} must be 1 to {setting('fit_tokens')} ({fit_tokens})"
        )
    # Speculative steps emit at most the trace's tokens: k + 1 more cover the last pass.
    return synthetic_workload(
        synthetic,
        tokens=tokens + draft_length + 1,
        fit_tokens=fit_tokens,
        fit_documents=fit_documents,
        reuse2=reuse2,
        local_popularity=local_popularity,
        seed=seed,
    )


@dataclass
class Simulation:
    """Policies compared on one workload, profile and settings; the report's data if made."""

    workload: object
    profile: object
    settings: SimulationSettings
    results: dict[str, dict]
    report: dict | None = None


def simulation(
    names,
    profile,
    *,
    trace=None,
    synthetic: str | None = None,
    cache_ratio: float = 0.25,
    draft_length: int = 8,
    acceptance: float = 0.7,
    draft_stop: float = 0.0,
    tokens: int = 2048,
    fit_tokens: int = 512,
    fit_documents: int = 1,
    reuse2: float | None = None,
    local_popularity: float = 0.0,
    seed: int = 0,
    report: bool = False,
    progress=None,
) -> Simulation:
    """What `moespec simulate` shows: each named policy on the workload (a recorded trace or
    a synthetic shape) and profile, and with `report` the comparisons of `full_report`.
    progress: a `moespec.progress.Progress`, or None."""
    from moespec.progress import Progress

    progress = progress or Progress(False)
    progress.start("reading the trace" if trace else "making the synthetic trace")
    workload = load_workload(
        trace,
        synthetic,
        tokens=tokens,
        fit_tokens=fit_tokens,
        fit_documents=fit_documents,
        draft_length=draft_length,
        reuse2=reuse2,
        local_popularity=local_popularity,
        seed=seed,
    )
    settings = settings_for(
        workload,
        cache_ratio=cache_ratio,
        draft_length=draft_length,
        acceptance=acceptance,
        draft_stop=draft_stop,
        tokens=tokens,
        seed=seed,
    )
    progress.start("simulating", total=len(names), unit="runs")
    results = compare_policies(workload, names, profile, settings, progress.step)
    data = full_report(workload, names, profile, settings, progress) if report else None
    return Simulation(workload, profile, settings, results, data)


def full_report(workload, names, profile, settings, progress=None) -> dict:
    """The data of seed 003's comparisons for `moespec.report.offload.write_report`: Table 1
    (policies, the autoregressive baselines too, x the paper's acceptances), Table 2 (SpAc's
    ablations), Figure 5 (the cache ratio) and the draft length swept, with provenance."""
    from dataclasses import asdict

    from moespec.progress import Progress
    from moespec.provenance import provenance

    progress = progress or Progress(False)
    baselines_ar = [f"{n}-ar" for n in ("lru", "static", "hybrid")]
    table_names = list(dict.fromkeys([*names, *baselines_ar]))
    draft_lengths = [k for k in DRAFT_LENGTHS if k + 1 <= settings.tokens]
    runs = len(names) * (len(CACHE_RATIOS) + len(draft_lengths))
    runs += len(table_names) * len(PAPER_ACCEPTANCES) + len(ABLATIONS)
    progress.start("simulating the report", total=runs, unit="runs")
    step = progress.step
    trace = workload.trace
    data = {
        "settings": asdict(settings),
        "profile": profile.to_dict(),
        "workload": {
            "name": workload.name,
            "layers": trace.num_layers,
            "experts": trace.num_experts,
            "top_k": trace.top_k,
            "metadata": trace.metadata,
        },
        "table1": workload_table(workload, table_names, profile, settings, progress=step),
        "table2": ablation_table(workload, profile, settings, step),
        "figure5": sweep(workload, names, profile, settings, "cache_ratio", CACHE_RATIOS, step),
        "draft_length": sweep(
            workload, names, profile, settings, "draft_length", draft_lengths, step
        ),
        "provenance": provenance(),
    }
    data["workload"]["smape"] = data["table2"][0]["frequency_smape"]
    return data
