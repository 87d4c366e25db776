"""The plan's calibration measured again inside the evaluation's process, in shares between its
phases, so that the chain and the runs it is scored on share one machine state.

Why: the chain (eq. 22) adds layer-time differences to tau_meas(1). Anchoring on the evaluation's
tau(1) removes drift from the anchor only; the differences (and, in the calibrated version, the
growth g(n) of whole-model passes) stay those of the plan's process. On the 2-core hosts these
moved every pass alike by 1.19-1.26x between a plan and its evaluation minutes later (demo
target, tau(1) 0.319 against 0.268 ms), and that ratio landed in each verify-time error.

What is measured is the plan's own calibration, nothing of the text it is scored on: the
expert-operation benchmark on the plan's cases (chosen ids and recorded windows of the fit
documents, the plan's benchmark settings and cache state), cut into `shares` strided parts of
its shuffled case list, and whole-model passes of both kernels, a few rounds per share, at the
depth the evaluation verifies at. By default (`text="continuations"`) share i's passes run on
the target's greedy continuation of the i-th fit document's start, the kind of text decoding
verifies, from documents the evaluation never scores on (as `moespec plan` times its own);
`text="documents"` runs them on the test documents (as plans did before). After the last share the
fits, epsilon and the three versions are made from these records exactly as `moespec plan`
makes them (`plan.prediction_versions`), and the evaluation anchors them on its tau(1) and
scores them beside the plan's versions.
"""

from dataclasses import dataclass, fields

import numpy as np

from moespec.calibrate.bench import BenchSettings, ExpertOpBenchmark
from moespec.calibrate.texts import fit_continuations, verify_text
from moespec.calibrate.timing import CacheFlusher
from moespec.calibrate.verify import STREAM_PASSES, measure_verify, verify_table
from moespec.errors import SettingError, setting

TEXTS = ("continuations", "documents")


@dataclass
class InProcessResult:
    """The calibration's measurements and what the plan's chain makes of them."""

    measured: object  # plan.Measured
    whole_times: dict  # kernel -> np.ndarray [n_max]: the plan text's whole-model medians
    verify_records: list[dict]
    chain: object  # plan.Chain
    cases: int


class InProcessCalibration:
    """The plan's benchmark and whole-model passes, run in `shares` parts (`share(i)`), each a
    phase of the evaluation; `result()` once every share has run or been resumed (`keep`)."""

    def __init__(
        self,
        plan,
        model,
        tokenizer,
        shares: int,
        verify_repeats: int,
        progress=None,
        depth: int | None = None,
        text: str = "continuations",
        prompt_tokens: int = 64,
        tokens: int = 256,
        mode: str | None = None,
        passes: int | None = None,
    ):
        """depth: of the whole-model passes (default: the plan's). text: what they run on,
        "continuations" (share i: the target's greedy continuation of `tokens` tokens after
        the first `prompt_tokens` of the i-th fit document) or "documents" (the plan's
        verify text, the test documents one after another). mode, passes: how a pass is
        timed (`calibrate.verify.time_pass`; default: as the plan timed its passes)."""
        from moespec.calibrate.plan import routing_trace, windows_by_layer

        trace_source = plan.provenance.settings.get("trace")
        if trace_source is not None:
            raise SettingError(
                f"the plan's routing came from the trace {trace_source}; calibrating in the "
                "evaluation's process records it on the embedded corpus: evaluate with "
                f"{setting('calibration', 'plan')}"
            )
        if shares < 1 or verify_repeats < 1:
            raise ValueError("an in-process calibration needs shares and verify_repeats >= 1")
        names = {f.name for f in fields(BenchSettings)}
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in plan.bench.settings.items()}
        values.setdefault("batch_invariant", False)  # a plan made before the setting: off
        self.settings = BenchSettings(**{k: v for k, v in values.items() if k in names})
        self.model, self.shares, self.verify_repeats = model, shares, verify_repeats
        self.per_layer = plan.fits_per_layer
        layers = list(plan.bench.layers)
        self.trace = routing_trace(  # as the plan recorded it (a plan before the cap: all)
            model,
            tokenizer,
            None,
            plan.model_dir,
            progress or _quiet(),
            plan.provenance.settings.get("trace_tokens"),
        )
        windows = windows_by_layer(
            self.trace,
            layers,
            self.settings.pass_sizes,
            plan.bench.windows_per_pass,
            self.settings.seed,
        )
        self.header = {"model": model.config.name, "dtype": plan.dtype}
        experts = {layer: model.moe_blocks[layer].experts for layer in layers}
        self.bench = ExpertOpBenchmark(
            experts,
            model.config.top_k,
            self.settings,
            windows,
            header=self.header,
            native=model.native_step() is not None,
        )
        self.cases = self.bench.cases()  # shuffled by the plan's seed, as the plan ran them
        flush_bytes = self.settings.flush_bytes or 0
        self.flush = CacheFlusher(flush_bytes) if flush_bytes else None
        if text not in TEXTS:
            raise ValueError(f"in-process calibration text {text!r}: expected one of {TEXTS}")
        self.text_kind = text
        if text == "documents":
            self.texts = [verify_text(tokenizer)]
        else:
            self.texts = fit_continuations(model, tokenizer, shares, prompt_tokens, tokens)
        chain_settings = plan.provenance.settings
        self.depth = depth if depth is not None else chain_settings.get("depth", 256)
        self.mode = mode or chain_settings.get("verify_mode", "isolated")
        self.passes = passes or chain_settings.get("stream_passes", STREAM_PASSES)
        self.kernels = [k for k in self.settings.kernels if k != "reference"]
        self.bench_records: list[dict] = []
        self.verify_samples: dict[tuple[str, int], list[float]] = {}
        self.done: set[int] = set()

    def share(self, index: int) -> dict:
        """Run share `index` (0 .. shares - 1): its cases of the benchmark and verify_repeats
        rounds of the whole-model passes (one warm-up round first). Returns its samples (what
        `keep` takes back from a journal)."""
        import torch

        with torch.inference_mode():
            bench = [self.bench.measure(c, self.flush) for c in self.cases[index :: self.shares]]
        verify = measure_verify(
            self.model,
            self.texts[index % len(self.texts)],
            depth=self.depth,
            pass_sizes=self.settings.pass_sizes,
            kernels=self.kernels,
            repeats=self.verify_repeats,
            warmup=1,
            seed=index,
            mode=self.mode,
            passes=self.passes,
        )
        samples = {"share": index, "bench": bench, "verify": verify}
        self.keep(samples)
        return samples

    def keep(self, samples: dict) -> None:
        if samples["share"] in self.done:
            return
        self.done.add(samples["share"])
        self.bench_records += samples["bench"]
        for r in samples["verify"]:
            self.verify_samples.setdefault((r["kernel"], r["n_tokens"]), []).extend(r["seconds"])

    def result(self) -> InProcessResult:
        """The fits, epsilon, whole-model medians and chain of every share's records."""
        from moespec.calibrate.plan import measured_from_records, prediction_versions, trace_routing
        from moespec.calibrate.timing import median_iqr

        missing = sorted(set(range(self.shares)) - self.done)
        if missing:
            raise RuntimeError(f"in-process calibration: shares {missing} have not run")
        measured = measured_from_records(
            self.bench_records, self.model.config.top_k, self.settings.kernels, self.per_layer
        )
        records = []
        for (kernel, n), values in sorted(self.verify_samples.items(), key=lambda x: x[0][::-1]):
            median, iqr = median_iqr(values)
            records.append(
                {"kernel": kernel, "n_tokens": n, "seconds": values, "median": median, "iqr": iqr}
            )
        max_n = max(self.settings.pass_sizes)
        whole = {k: np.array(verify_table(records, k, max_n)) for k in measured.kernels}
        routing = trace_routing(self.trace, max_n)
        _, chain = prediction_versions(self.model, routing, measured, whole, np.zeros(max_n), max_n)
        return InProcessResult(measured, whole, records, chain, len(self.bench_records))


def _quiet():
    from moespec.progress import Progress

    return Progress(False)
