"""The simulations behind the report: seed 003 Table 1, Table 2 and Figure 5, and sweeps.

Every function returns plain data (lists of dicts from `SimulationResult.to_dict`), so the CLI,
the benchmark and the report consume the same numbers. `progress(label)` is called before each
simulation (for a progress bar); every simulation replays the same workload with a fresh policy.
"""

from dataclasses import replace

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
