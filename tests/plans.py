"""A complete typed plan around given predictions, for tests of the plan's readers."""

from moespec.plan import (
    BenchRun,
    KernelChoice,
    ModelRouting,
    ModelSignature,
    Plan,
    PredictionSummary,
    Provenance,
    typed,
)


def plan_around(predictions: dict, crossover, draft_time, dedup_kernel: str = "dedup") -> Plan:
    """A Plan whose predictions ({version: Prediction.to_dict()}), kernel switch and draft
    times are those given; its other fields are small placeholders of the right types."""
    max_n = len(draft_time)
    chosen = typed(PredictionSummary, predictions["calibrated"])
    return Plan(
        model=ModelSignature("test", "qwen3_moe", 2, 16, 8, 2, 8),
        model_dir="test",
        draft_dir=None,
        dtype="fp32",
        provenance=Provenance(device="cpu", threads=1, versions={}),
        bench=BenchRun(settings={}, layers=[0], windows_per_pass=1, raw="bench.jsonl"),
        read_bandwidth=1e10,
        fits={},
        bandwidth_error=0.0,
        bandwidth={},
        bandwidth_ratio={},
        routing=ModelRouting(1, 1, [1.0] * max_n, [0.0] * max_n, [[1.0] * max_n]),
        measured_verify={},
        verify_records=[],
        predictions={name: typed(PredictionSummary, p) for name, p in predictions.items()},
        plan_version="calibrated",
        kernel=KernelChoice(crossover, dedup_kernel),
        verify_time=chosen.verify_time["slot"],
        draft_time=list(draft_time),
        step_times=chosen.staircase.step_times,
        seconds=0.0,
    )
