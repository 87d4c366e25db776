"""One evaluation harness, one process: whole-model verify times and the speculative sweep,
interleaved, on the same token stream, then the plan's prediction anchored on this run and
scored by the six rules of seed 000 Table 8 with the noise floor beside them.

Why one process: the chain (eq. 22) adds layer-time differences to tau_meas(1), and the rules
compare against runs; when tau(1) comes from another process the machine's drift (tens of
percent on a shared host) lands in every verify-time error. Here every phase is logged with
the machine's read bandwidth before and after it.

The stream: each prompt (the start of a held-out test document) is followed by the target's
greedy continuation of `tokens` tokens; the sweep decodes exactly that continuation (greedy
speculative output equals plain), and the verify phases time passes of n = 1..9 of its tokens
on a cache holding the prompt and half of it (depth = the middle of the decoded span).

The sweep (seed 000 §4.3): the oracle draft at acceptance a for k = 0..k_max, each cell
`prompts` x `repeats` runs of `tokens` tokens, with common random numbers (each run's
per-position draft flags are shared by every (a, k) cell: `OracleDrafter(positional=True)`),
and a verify phase before the first repeat and after each. The order (`sweep_order`):
"blocks" (the default) runs one block per (acceptance, prompt) in a random order within each
repeat, and in each block the k_max + 1 draft lengths back to back in a random order, so the
runs a row's k* and loss compare are seconds apart; "cells" runs whole (a, k) cells in a random
order, a row's cells then lie up to a whole phase apart (the order of the earlier scorecards:
on the demo the machine's read bandwidth moved between 52 and 34 GB/s within one phase, and
that drift landed in the row's comparisons).

A wrong draft (`corruption`): "runner-up" (the default) proposes the target's best token
other than the greedy one at that position (`decoding.setup.runner_up_tokens`), the mistake a
draft model makes; "uniform" a token drawn from the whole vocabulary (the scorecards before
this reading). The choice moves the deduplicating pass, which pays for the experts its tokens
route to: uniform tokens route unlike text, so the sweep's passes cost more than the verify
phases' passes of greedy tokens and than the U(n) of text the prediction assumes
(`benchmarks/corruption_cost.py`: on OLMoE shapes a 9-token pass at a = 0.5 took 1.067x the
greedy tokens' pass with uniform wrong drafts, 1.035x with runner-up ones).

The sweep runs with deduplication on (the per-slot kernel at n = 1, where both read the same
experts) and the prediction scores V_hat(k) = tau_hat_dedup(k + 1) + h(k), as the
paper does; the oracle costs nothing (h = 0).
"""

import random
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from moespec.calibrate.fits import LayerFits
from moespec.calibrate.inprocess import TEXTS
from moespec.calibrate.predict import (
    ACCEPTANCES,
    Prediction,
    anchored_predictions,
    outside_growth,
    ratio_anchored,
    times_from_layer_fits,
    verify_times,
)
from moespec.calibrate.score import (
    measured_best,
    measured_verify_times,
    noise_floor,
    round_paired,
    rule_verify_time,
    score_prediction,
)
from moespec.calibrate.timing import median_iqr, read_bandwidth
from moespec.calibrate.verify import STREAM_PASSES, VERIFY_MODES, pass_span, round_order, time_pass
from moespec.decoding import DraftLengthPolicy, KernelPolicy, OracleDrafter, generate
from moespec.decoding.setup import greedy_reference, runner_up_tokens
from moespec.errors import SettingError, setting
from moespec.plan import Plan
from moespec.progress import Progress
from moespec.routing.reuse import document_statistics, estimate

SWEEP_ORDERS = ("blocks", "cells")
CORRUPTIONS = ("runner-up", "uniform")
CALIBRATIONS = ("here", "plan")


@dataclass
class EvaluationSettings:
    """prompts x repeats runs of `tokens` tokens per (a, k) cell; verify passes timed
    `verify_repeats` times per prompt and phase."""

    prompts: int = 6
    prompt_tokens: int = 64
    tokens: int = 256
    repeats: int = 3
    max_draft_length: int = 8
    acceptances: tuple[float, ...] = ACCEPTANCES
    verify_repeats: int = 3
    seed: int = 0
    bandwidth_bytes: int = 1 << 30  # the buffer each read-bandwidth reading sums
    sweep_order: str = "blocks"  # or "cells" (see the module's docstring)
    corruption: str = "runner-up"  # what a wrong draft proposes, or "uniform" (module docstring)
    verify_mode: str = "stream"  # how a verify pass is timed, or "isolated" (calibrate.verify)
    stream_passes: int = STREAM_PASSES  # timed passes of one "stream" value
    # "here": the plan's calibration measured again in this process, in a share before each
    # verify phase, and its versions scored beside the plan's ("_here"; calibrate.inprocess);
    # "plan": the plan's versions only
    calibration: str = "here"
    # what the in-process calibration's whole-model passes run on (calibrate.inprocess.TEXTS)
    calibration_text: str = "continuations"

    def __post_init__(self):
        choices = {
            "calibration": CALIBRATIONS,
            "calibration_text": TEXTS,
            "corruption": CORRUPTIONS,
            "sweep_order": SWEEP_ORDERS,
            "verify_mode": VERIFY_MODES,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"evaluation {name} {getattr(self, name)!r}: expected one of "
                    + ", ".join(allowed)
                )
        names = ("prompts", "prompt_tokens", "tokens", "repeats", "verify_repeats", "stream_passes")
        for name in names:
            if getattr(self, name) < 1:
                raise ValueError(f"evaluation setting {name} must be >= 1")
        if self.tokens < 2 * (self.max_draft_length + 1):
            raise ValueError(
                f"evaluation tokens ({self.tokens}) must be at least twice the largest pass "
                f"({self.max_draft_length + 1})"
            )
        # the verify passes run around the middle of the decoded span (prompt + tokens // 2)
        depth = self.prompt_tokens + self.tokens // 2
        n = self.max_draft_length + 1
        first, end = pass_span(depth, n, self.verify_mode, self.stream_passes)
        if first < 0 or end > self.prompt_tokens + self.tokens:
            raise SettingError(
                f"evaluation: a {self.verify_mode} verify measurement of {n} tokens "
                f"({self.stream_passes} timed passes) spans {end - first} tokens, more than "
                f"the {self.prompt_tokens + self.tokens} of a prompt and its run; raise "
                f"{setting('tokens')} or lower {setting('stream_passes')}"
            )


def spread(values) -> dict:
    """Median, smallest and largest of a list of ratios."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def evaluation_prompts(tokenizer, count: int, prompt_tokens: int) -> list[list[int]]:
    """The first `prompt_tokens` tokens of `count` held-out test documents (never in the fit
    part that U(n) and the benchmark windows come from)."""
    from moespec.calibrate.plan import verify_documents
    from moespec.routing.record import tokenize_documents

    documents = tokenize_documents(tokenizer, verify_documents(count * 2))
    prompts = [ids[:prompt_tokens] for _, ids in documents if len(ids) >= prompt_tokens]
    if len(prompts) < count:
        raise ValueError(
            f"the held-out test documents give {len(prompts)} prompts of {prompt_tokens} "
            f"tokens, {count} asked"
        )
    return prompts[:count]


def stream_trace(model, streams: list[list[int]], start: int):
    """The routing of the decoded spans (each stream's tokens from `start` on, routed in
    their context), one document per stream: the text the runs verified."""
    from moespec.routing.record import model_header, record_routing
    from moespec.routing.trace import RoutingTrace

    header = model_header(model)
    spans = [
        doc.expert_ids[start:]
        for doc in record_routing(model, [(str(i), s) for i, s in enumerate(streams)])
    ]
    return RoutingTrace(
        expert_ids=np.concatenate(spans),
        doc_starts=np.concatenate([[0], np.cumsum([len(x) for x in spans])]),
        doc_names=[str(i) for i in range(len(spans))],
        num_experts=header["num_experts"],
        expert_bytes=header["expert_bytes"],
        layer_indices=header["layer_indices"],
    )


def stream_reuse(trace) -> float:
    """rho_hat(2) of the decoded spans (`stream_trace`): the share of a token's experts that
    the previous token also routed to, layer mean; the plan's trace is judged by it."""
    shares = []
    for d in range(len(trace.doc_names)):
        span = trace.expert_ids[trace.doc_starts[d] : trace.doc_starts[d + 1]]
        ids = np.sort(span, axis=-1)  # [T, L, m]
        shared = (ids[:-1, :, :, None] == ids[1:, :, None, :]).any(-1).sum(-1)
        shares.append(shared.mean() / ids.shape[-1])
    return float(np.mean(shares))


def stream_versions(plan: Plan, trace, plain: float, **prediction) -> dict:
    """Seed 000 Table 3's other prediction: the plan's fits at the union U_l(n) of the text
    the runs verified (`trace`, every window of n tokens of the decoded spans) instead of the
    plan's fit documents, anchored on this run's tau(1): "prediction_stream", and with the
    plan's growth outside the expert operation, g(n) = the plan's whole-model per-slot tau(n)
    less the fits' expert time at the plan's unions: "calibrated_stream". Where the decoded
    text reuses experts unlike the fit documents (a random-weight model's greedy continuation
    repeats itself), these separate the fits' error from the workload's."""
    max_n = len(plan.measured_verify["slot"])
    union = estimate(document_statistics(trace, max_n), bootstrap=0).union
    fits = LayerFits.from_plan(plan)
    times = times_from_layer_fits(fits, trace.layer_indices, union, trace.expert_bytes)
    at_plan = {k: np.asarray(v) for k, v in plan.chain.layer_times["prediction"].items()}
    growth = outside_growth(np.asarray(plan.measured_verify["slot"]), at_plan)
    return {
        name: Prediction(
            verify=verify_times(plain, times, g),
            expert_time={k: v.sum(axis=0) for k, v in times.items()},
            **prediction,
        )
        for name, g in (("prediction_stream", None), ("calibrated_stream", growth))
    }


class Evaluation:
    """The harness; `run()` returns the whole evaluation as a dict (see `evaluate`)."""

    def __init__(
        self,
        model,
        prompts,
        settings: EvaluationSettings,
        dedup_kernel="dedup",
        journal=None,
        calibration=None,
    ):
        self.model, self.prompts, self.settings = model, prompts, settings
        # calibrate.inprocess.InProcessCalibration: one share runs before each verify phase
        self.calibration = calibration
        # finished runs and phases (moespec.files.Journal): an interrupted evaluation resumes
        self.journal = journal
        earlier = journal.entries if journal is not None else []
        self.done_runs = {tuple(e["run"][:4]): e for e in earlier if "run" in e}
        self.done_phases = {e["phase"]["phase"]: e for e in earlier if "phase" in e}
        self.resumed = {"runs": 0, "phases": []}
        # as the engine runs by default: a verify pass gives each token the bits it gets
        # alone, so in bf16 too the sweep decodes exactly the greedy continuation
        model.batch_invariant = True
        self.kernels = ("slot", dedup_kernel)
        self.sweep_kernels = KernelPolicy("auto", crossover=2)  # dedup on (slot at n = 1)
        self.references = [
            greedy_reference(model, p, settings.tokens, self.sweep_kernels) for p in prompts
        ]
        self.alternatives = [None] * len(prompts)  # uniform corruption
        if settings.corruption == "runner-up":
            self.alternatives = [
                runner_up_tokens(model, p, r, dedup_kernel)
                for p, r in zip(prompts, self.references, strict=True)
            ]
        self.depth_offset = settings.tokens // 2
        self.verify_samples: dict[tuple[str, int], list[float]] = {}
        # each sample's round ("phase/index in the phase"): a round times each (kernel, n) once,
        # so the scorer pairs a round's passes (moespec.calibrate.score); None once a sample
        # without its round is resumed from an older journal
        self.verify_rounds: dict[tuple[str, int], list[str]] | None = {}
        self.rounds = random.Random(settings.seed)  # the verify rounds' orders
        self.phases: list[dict] = []
        self.diverged = 0  # runs whose output left the plain greedy continuation

    # -- verify times -------------------------------------------------------------------
    def verify_phase(self, phase: str | None = None) -> list:
        """Time passes of n = 1..k_max+1 tokens of each prompt's continuation, both kernels,
        interleaved in a fresh random order each round (`calibrate.verify.round_order`), each
        at the depth of prompt + half the continuation, as `settings.verify_mode` times a pass
        (`calibrate.verify.time_pass`: by default within a run of consecutive passes through
        the continuation, as the sweep's decoding runs them). Returns the samples
        [kernel, n, seconds, round] (kept in verify_samples where `phase` names the phase;
        the warm-up's, phase None, are not)."""
        s, model = self.settings, self.model
        samples = []
        sizes = range(1, s.max_draft_length + 2)
        mode, passes = s.verify_mode, s.stream_passes
        for prompt, reference in zip(self.prompts, self.references, strict=True):
            stream = prompt + reference
            depth = len(prompt) + self.depth_offset
            end = max(pass_span(depth, n, mode, passes)[1] for n in sizes)
            cache = model.new_cache(capacity=end + 1)
            model(torch.tensor(stream[:depth]), cache, kernel="dedup")
            for _ in range(s.verify_repeats):
                round_id = f"{phase}/{len(samples) // (len(self.kernels) * len(sizes))}"
                for n, kernel in round_order(sizes, self.kernels, self.rounds):
                    elapsed = time_pass(
                        model, cache, stream, depth, n, kernel, mode=mode, passes=passes
                    )
                    samples.append([kernel, n, elapsed, round_id])
        if phase is not None:
            self.keep_samples(samples)
        return samples

    def keep_samples(self, samples) -> None:
        for kernel, n, elapsed, *round_id in samples:
            self.verify_samples.setdefault((kernel, n), []).append(elapsed)
            if not round_id:
                self.verify_rounds = None
            elif self.verify_rounds is not None:
                self.verify_rounds.setdefault((kernel, n), []).append(round_id[0])

    # -- the sweep ----------------------------------------------------------------------
    def drafter(self, acceptance: float, repeat: int, index: int) -> OracleDrafter:
        """The oracle of one run: its flags drawn from (seed, repeat, prompt), so every (a, k)
        cell of a repeat sees the same; a wrong draft as `settings.corruption` says."""
        return OracleDrafter(
            self.references[index],
            len(self.prompts[index]),
            acceptance,
            self.model.config.vocab_size,
            seed=self.settings.seed * 100_003 + repeat * 1_009 + index,
            resync=lambda c, n: greedy_reference(self.model, c, n, self.sweep_kernels),
            positional=True,
            alternatives=self.alternatives[index],
            alternatives_for=lambda c, tail: runner_up_tokens(self.model, c, tail, self.kernels[1]),
        )

    def run_one(self, acceptance: float, k: int, repeat: int, index: int):
        """One run of `tokens` tokens on prompt `index`: (decode tokens, decode seconds without
        the oracle's, and (step seconds without the oracle's, verify seconds) of each of its
        steps that drafted k tokens."""
        prompt, reference = self.prompts[index], self.references[index]
        drafter = self.drafter(acceptance, repeat, index)
        records = list(
            generate(
                self.model,
                prompt,
                max_tokens=self.settings.tokens,
                kernels=self.sweep_kernels,
                drafter=drafter,
                draft_policy=DraftLengthPolicy(k),
            )
        )
        decode = [r for r in records if r.phase == "decode"]
        emitted = [t for r in records for t in r.tokens]
        self.diverged += emitted != reference[: len(emitted)]
        tokens = sum(len(r.tokens) for r in decode)
        seconds = sum(r.seconds - r.draft_seconds for r in decode)
        steps = [(r.seconds - r.draft_seconds, r.verify_seconds) for r in decode if r.drafted == k]
        return tokens, seconds, steps

    def _phase(self, name: str, fn, keep=None) -> None:
        """Run one phase between two read-bandwidth readings, journaled (a verify or
        calibration phase with its samples); one an earlier, interrupted run finished is taken
        from its journal (its samples given to `keep`, by default the verify samples')."""
        if name in self.done_phases:
            entry = self.done_phases[name]
            (keep or self.keep_samples)(entry.get("samples", []))
            if name.startswith("sweep"):
                fn()  # every run of it is in the journal: taken from there, none runs
            self.phases.append(entry["phase"])
            self.resumed["phases"].append(name)
            return
        before = read_bandwidth(self.settings.bandwidth_bytes)
        start = time.perf_counter()
        samples = fn()
        record = {
            "phase": name,
            "seconds": time.perf_counter() - start,
            "read_bandwidth_before": before,
            "read_bandwidth_after": read_bandwidth(self.settings.bandwidth_bytes),
        }
        self.phases.append(record)
        if self.journal is not None:
            self.journal.append({"phase": record, **({"samples": samples} if samples else {})})

    def run(self, progress: Progress | None = None) -> dict:
        s = self.settings
        progress = progress or Progress(False)
        ks = list(range(s.max_draft_length + 1))
        prompts = range(len(self.prompts))
        # per (a, k) cell and repeat: [tokens, seconds] pooled over the prompts
        pooled = {(a, k): [[0, 0.0] for _ in range(s.repeats)] for a in s.acceptances for k in ks}
        per_run = {}  # (a, k, repeat, prompt): tokens/s, for the paired speedups
        step_samples = {k: [] for k in ks}
        order = random.Random(s.seed)
        # warm-up, alike for every arm: one verify phase and one run per k, discarded
        self.verify_phase()
        for k in ks:
            self.run_one(0.9, k, repeat=-1, index=0)
        runs = s.repeats * len(s.acceptances) * len(ks) * len(self.prompts)
        progress.start("evaluating: verify phases and the sweep", total=runs)

        log = []  # every run in the order it ran: a, k, repeat, prompt, tokens, seconds, start
        began = time.perf_counter()

        def one(a, k, repeat, index):
            earlier = self.done_runs.get((a, k, repeat, index))
            if earlier is not None:  # finished by an interrupted run: its journal entry
                row, steps = earlier["run"], [tuple(x) for x in earlier["steps"]]
                tokens, seconds = row[4], row[5]
                self.resumed["runs"] += 1
            else:
                start = time.perf_counter() - began
                tokens, seconds, steps = self.run_one(a, k, repeat, index)
                row = [a, k, repeat, index, tokens, seconds, start]
                if self.journal is not None:
                    self.journal.append({"run": row, "steps": steps})
            log.append(row)
            pooled[a, k][repeat][0] += tokens
            pooled[a, k][repeat][1] += seconds
            per_run[a, k, repeat, index] = tokens / seconds
            step_samples[k] += steps
            progress.advance()

        self._calibration_share(0)
        self._phase("verify 0", lambda: self.verify_phase("verify 0"))
        for repeat in range(s.repeats):
            if s.sweep_order == "blocks":
                blocks = [(a, i) for a in s.acceptances for i in prompts]
                runs = [
                    (a, k, i)
                    for a, i in order.sample(blocks, len(blocks))
                    for k in order.sample(ks, len(ks))
                ]
            else:
                cells = [(a, k) for a in s.acceptances for k in ks]
                runs = [(a, k, i) for a, k in order.sample(cells, len(cells)) for i in prompts]

            def sweep(runs=runs, repeat=repeat):
                for a, k, i in runs:
                    one(a, k, repeat, i)

            self._phase(f"sweep {repeat}", sweep)
            self._calibration_share(repeat + 1)
            name = f"verify {repeat + 1}"
            self._phase(name, lambda name=name: self.verify_phase(name))
        rates = {cell: [t / sec for t, sec in values] for cell, values in pooled.items()}
        results = self._results(rates, per_run, step_samples)
        results["resumed"] = self.resumed
        results["sweep"]["log"] = log
        results["sweep"]["log_columns"] = [
            "acceptance",
            "k",
            "repeat",
            "prompt",
            "tokens",
            "seconds",
            "start",
        ]
        return results

    def _calibration_share(self, index: int) -> None:
        if self.calibration is not None:
            share = self.calibration
            self._phase(f"calibration {index}", lambda: share.share(index), keep=share.keep)

    def _results(self, rates, per_run, step_samples) -> dict:
        s = self.settings
        by_acceptance = {}
        for a in s.acceptances:
            medians = {k: statistics.median(rates[a, k]) for k in range(s.max_draft_length + 1)}
            blocks = [(r, i) for r in range(s.repeats) for i in range(len(self.prompts))]
            paired = {
                k: [per_run[a, k, r, i] / per_run[a, 0, r, i] for r, i in blocks] for k in medians
            }
            row = {
                "tokens_per_second": medians,
                "runs": {k: rates[a, k] for k in medians},
                "speedup": {k: medians[k] / medians[0] for k in medians},
                # per (repeat, prompt): the run's tokens/s over the same prompt's k = 0 run of
                # the same repeat (seconds apart in the "blocks" order): median and range; the
                # rules and the measured best take these (moespec.calibrate.score)
                "paired_speedup": {k: spread(v) for k, v in paired.items()},
            }
            best = measured_best(row)
            row["measured_best"] = best
            row["measured_best_speedup"] = row["paired_speedup"][best]["median"]
            by_acceptance[str(a)] = row
        records = []
        for (kernel, n), values in sorted(self.verify_samples.items(), key=lambda x: x[0][::-1]):
            median, iqr = median_iqr(values)
            record = {
                "kernel": kernel,
                "n_tokens": n,
                "seconds": values,
                "median": median,
                "iqr": iqr,
            }
            if self.verify_rounds is not None:
                record["rounds"] = self.verify_rounds[kernel, n]
            records.append(record)
        ks = sorted(step_samples)
        return {
            "sweep": {
                "by_acceptance": by_acceptance,
                # the sweep's own V(k): the median step that drafted k tokens, as tokens/s pays
                # it (the whole step without the oracle's time), which the noise floor takes k*
                # from; beside it the verify pass alone (with acceptance and rollback)
                "step_times": [statistics.median(t for t, _ in step_samples[k]) for k in ks],
                "verify_step_times": [statistics.median(v for _, v in step_samples[k]) for k in ks],
            },
            "verify_records": records,
            "phases": self.phases,
            "runs_off_the_greedy_continuation": self.diverged,
        }


def journal_header(plan: Plan, settings: EvaluationSettings) -> dict:
    """What an evaluation's journal must match to be resumed: the plan's model and dtype, its
    one-token time (a remade plan starts afresh), the settings and the thread count."""
    return {
        "evaluation": asdict(settings),
        "model": asdict(plan.model),
        "model_dir": plan.model_dir,
        "dtype": plan.dtype,
        "plan_plain_time": plan.measured_verify["slot"][0],
        "threads": torch.get_num_threads(),
    }


def evaluate(
    plan: Plan, model, tokenizer, settings: EvaluationSettings, progress=None, journal=None
) -> dict:
    """Run the harness for a plan made for `model`; anchor each of the plan's versions on this
    run's tau_meas(1) and score it; the noise floor (k* from the sweep's own V(k)) beside.
    The calibrated version is scored a second time re-anchored by the ratio of the one-token
    times (`predict.ratio_anchored`, "calibrated_by_ratio"), the reading for drift between
    the plan's run and this one that scales every pass alike. And the plan's fits at the
    routing of the text the runs verified (`stream_versions`: "prediction_stream",
    "calibrated_stream"), seed 000 Table 3's other prediction. With `settings.calibration`
    "here", the plan's calibration is measured again in this process, a share before each
    verify phase (`calibrate.inprocess`), and its three versions, anchored on the same
    tau(1), are scored too ("prediction_here", "measured_time_here", "calibrated_here"; what
    it measured under "in_process").

    journal: a `moespec.files.Journal` (header `journal_header`) that every finished run and
    phase is appended to, and that an interrupted evaluation's finished work is taken from
    (its sweep order is the same: the seed draws it); "resumed" counts what was.

    Returns settings, stream (depth, the decoded span's rho_hat(2) beside the plan's), sweep,
    verify_records, phases (read bandwidth before and after each), anchor, versions
    {name: {prediction, score}}, noise_floor, resumed and (calibration "here") in_process."""
    if plan.chain is None:
        raise ValueError("the plan keeps no prediction chain (made by an older moespec): remake it")
    dedup = plan.kernel.dedup_kernel
    prompts = evaluation_prompts(tokenizer, settings.prompts, settings.prompt_tokens)
    calibration = None
    if settings.calibration == "here":
        from moespec.calibrate.inprocess import InProcessCalibration

        calibration = InProcessCalibration(
            plan,
            model,
            tokenizer,
            settings.repeats + 1,
            settings.verify_repeats,
            progress,
            depth=settings.prompt_tokens + settings.tokens // 2,  # where the verify phases sit
            text=settings.calibration_text,
            prompt_tokens=settings.prompt_tokens,
            tokens=settings.tokens,
            mode=settings.verify_mode,  # timed as the verify phases time theirs
            passes=settings.stream_passes,
        )
    harness = Evaluation(model, prompts, settings, dedup, journal, calibration)
    results = harness.run(progress)
    plain = statistics.median(harness.verify_samples["slot", 1])
    draft_time = np.zeros(settings.max_draft_length + 1)  # the oracle costs nothing
    versions = anchored_predictions(
        plan.chain,
        plain,
        bandwidth_error=plan.bandwidth_error,
        draft_time=draft_time,
        dedup_kernel=dedup,
        step_kernel=dedup,
    )
    plan_plain = plan.measured_verify["slot"][0]
    # the calibrated version's inputs are all whole-model times of the plan's run: scored
    # also re-anchored by the ratio of the one-token times (drift that scales every pass)
    versions["calibrated_by_ratio"] = ratio_anchored(versions["calibrated"], plain, plan_plain)
    streams = [p + r for p, r in zip(prompts, harness.references, strict=True)]
    trace = stream_trace(model, streams, settings.prompt_tokens)
    versions |= stream_versions(
        plan,
        trace,
        plain,
        bandwidth_error=plan.bandwidth_error,
        draft_time=draft_time,
        dedup_kernel=dedup,
        step_kernel=dedup,
    )
    in_process = None
    if calibration is not None:
        here = calibration.result()
        anchored = anchored_predictions(
            here.chain,
            plain,
            bandwidth_error=here.measured.bandwidth_error,
            draft_time=draft_time,
            dedup_kernel=dedup,
            step_kernel=dedup,
        )
        versions |= {f"{name}_here": v for name, v in anchored.items()}
        in_process = {
            "cases": here.cases,
            "depth": calibration.depth,
            "text": calibration.text_kind,
            "bandwidth_error": here.measured.bandwidth_error,
            "kernel_bandwidth_error": here.measured.errors,
            "measured_verify": {k: v.tolist() for k, v in here.whole_times.items()},
            "plan_measured_verify": plan.measured_verify,
            "verify_records": here.verify_records,
            "bench_records": here.measured.records,
        }
    scored = {}
    unpaired = [{k: v for k, v in r.items() if k != "rounds"} for r in results["verify_records"]]
    raw = measured_verify_times(unpaired, dedup, settings.max_draft_length + 1)
    for name, prediction in versions.items():
        rules = score_prediction(
            prediction, results["verify_records"], results["sweep"], step_kernel=dedup
        )
        predicted = {k: list(v) for k, v in prediction.verify.items()}
        scored[name] = {
            "prediction": prediction.to_dict(),
            "score": {rule: {"holds": bool(h), "detail": d} for rule, (h, d) in rules.items()},
            # the verify-time rule against each (kernel, n)'s median sample instead
            "verify_error_against_medians": rule_verify_time(predicted, raw)[1],
        }
    floor = noise_floor(results["sweep"])
    plan_reuse = plan.routing.reuse_mean
    from moespec.provenance import provenance

    return {
        "provenance": provenance(settings=asdict(settings)),
        "settings": asdict(settings),
        "stream": {
            "prompts": len(prompts),
            "depth": [len(p) + harness.depth_offset for p in prompts],
            "decoded_reuse2": stream_reuse(trace),
            "plan_reuse2": plan_reuse[1] if plan_reuse and len(plan_reuse) > 1 else None,
        },
        **results,
        "anchor": {"plain_time": plain, "plan_plain_time": plan_plain},
        "versions": scored,
        "noise_floor": {rule: {"holds": bool(h), "detail": d} for rule, (h, d) in floor.items()},
        **({"in_process": in_process} if in_process is not None else {}),
    }


def scorecard(result: dict) -> str:
    """The six rules per version, the noise floor beside the two it applies to."""
    versions = list(result["versions"])
    rules = list(result["versions"][versions[0]]["score"])
    floor = result["noise_floor"]
    width = max(len(r) for r in rules)
    lines = [f"{'rule':<{width}}  " + "  ".join(f"{v:<22}" for v in versions) + "  noise floor"]
    for rule in rules:
        cells = []
        for version in versions:
            entry = result["versions"][version]["score"][rule]
            cells.append(f"{'holds' if entry['holds'] else 'fails'} ({entry['detail']})")
        noise = floor.get(rule)
        tail = f"{'holds' if noise['holds'] else 'fails'} ({noise['detail']})" if noise else "-"
        lines.append(f"{rule:<{width}}  " + "  ".join(f"{c:<22}" for c in cells) + f"  {tail}")
    rows = result["sweep"]["by_acceptance"]
    widths = {}
    for a, row in rows.items():
        paired = row.get("paired_speedup")
        if paired:
            best = paired.get(row["measured_best"]) or paired[str(row["measured_best"])]
            widths[a] = (best["max"] - best["min"]) / best["median"]
    if widths:
        widest = max(widths, key=widths.get)
        order = result["settings"].get("sweep_order", "cells")
        lines.append(
            f"sweep in {order} order; at each row's measured best k the runs' speedups over "
            f"the same prompt's k = 0 spread by up to {widths[widest]:.0%} of their median "
            f"(a = {widest})"
        )
    sweep = result["sweep"]
    if "verify_step_times" in sweep:
        pairs = zip(sweep["step_times"], sweep["verify_step_times"], strict=True)
        outside = [t - v for t, v in pairs]
        lines.append(
            f"the sweep's steps take {min(outside) * 1e3:.3f}-{max(outside) * 1e3:.3f} ms "
            "outside the verify pass (the noise floor's V(k) includes it, the prediction not)"
        )
    records = result["verify_records"]
    if round_paired(records) is not None:
        raw = ", ".join(
            f"{v} {e['verify_error_against_medians']}"
            for v, e in result["versions"].items()
            if "verify_error_against_medians" in e
        )
        lines.append(
            "verify times scored round by round (median tau(1) x the median of each round's "
            f"tau(n) / tau(1), {len(records[0]['seconds'])} rounds); against each (kernel, n)'s "
            f"median sample instead: {raw}"
        )
    here = result.get("in_process")
    if here is not None:
        mine, theirs = here["measured_verify"]["slot"], here["plan_measured_verify"]["slot"]
        lines.append(
            f"_here: the plan's calibration measured again in this process ({here['cases']} "
            f"benchmark cases, epsilon {here['bandwidth_error']:.3f}); its plan-text passes "
            f"tau(1) {mine[0] * 1e3:.3f} / tau({len(mine)}) {mine[-1] * 1e3:.3f} ms here, "
            f"{theirs[0] * 1e3:.3f} / {theirs[-1] * 1e3:.3f} ms in the plan's run"
        )
    anchor = result["anchor"]
    lines.append(
        f"anchor tau(1) = {anchor['plain_time'] * 1e3:.3f} ms here, "
        f"{anchor['plan_plain_time'] * 1e3:.3f} ms in the plan's run; decoded-span rho(2) "
        f"{result['stream']['decoded_reuse2']:.3f}"
    )
    return "\n".join(lines)
