"""A plan for llama.cpp from llama.cpp's own timings: should it speculate with this draft, and
with how many tokens, on this machine?

    plan = llamacpp_plan(Path("plan-dir"), gguf=Path("target.gguf"), draft_gguf=Path("d.gguf"))

1. τ(n), n = 1..n_max: llama.cpp's whole-model verification passes on a cache of fixed depth
   (the measured-time version of seed 000 eq. 22), h(k) of the draft GGUF (k greedy one-token
   passes), and the draft's acceptance on held-out text (teacher forced: the share of
   positions where the draft's and the target's greedy tokens agree).
2. A fit of τ(n) by the cost model of eq. (5) for a deduplicating engine (llama.cpp's
   `mul_mat_id` groups a pass's rows by expert, so each distinct expert is read once):
   τ(n) = t_0 + c_t n + B(n) / β, with B(n) = Σ_l U_l(n) w_l the expert bytes of the pass
   (U_l(n) from moespec's routing trace of the same checkpoint, a given trace, or uniform
   routing N(1 - q^n); w_l the bytes of one expert in the GGUF's weight type). Least
   squares with non-negative coefficients; the bandwidth error ε is the median relative error
   of the fit at each n when that n is left out of it.
   The fit covers the batched passes, n >= 2; the one-token pass is taken as measured.
   llama.cpp computes one row through its vector path and more rows through its matrix path,
   two kernels, as seed 000's engines have two: on the OLMoE-shaped Q8_0 checkpoint τ(2) is
   2.6-2.8x τ(1) (16.5 against 45.7 ms at 1 thread), which no single line in B(n) follows (a
   fit over all n put τ̂(1) at 32.8 ms and every k̂* at a <= 0.9 above the measured best, 0).
3. V̂(k) = τ̂(k + 1) + h(k), k̂*(a) over the acceptance grid with its speedup and whether ε can
   move it (Table 2), and the decision in llama.cpp's terms: `--spec-draft-n-max k
   --spec-draft-n-min k --spec-draft-p-min 0` (exactly k drafted tokens, as planned; older
   builds call the first two `--draft-max`/`--draft-min`), or no draft model when k̂* = 0.

Two versions of τ̂ (seed 000 scores its versions side by side, Table 3), both written to the
plan (`tau_versions`); `verify_times` chooses the one the decision follows:

    measured  τ̂(n) = τ(n) as measured, for every n the decision needs (n <= n_max, so
              k <= n_max - 1): the measured-time version, with the whole model's pass times,
              as this engine's timings give them. The default: llama.cpp switches kernels
              with the batch, and a line in B(n) cannot follow a switch. On the OLMoE-shaped
              Q8_0 checkpoint (1 thread) τ(8) was 97 ms against τ(7)'s 118 in the plan, and
              98 against 120 in the check run after it (the same dip: another matrix path at
              8 rows); the fit put τ̂(8) 15% above it and moved k̂* at a = 0.95.
    fitted    τ̂(n) from the fit above (τ(1) as measured): smooth in n, so it reads through
              a measurement's noise, but not through a kernel switch.

ε is the fit's in both (seed 000 takes ε from the fits for every version); it measures how
far llama.cpp's times stray from the cost model, which is what could move k̂*.
"""

import itertools
import statistics
import time
from pathlib import Path

import numpy as np

from moespec.calibrate import llamacpp
from moespec.costmodel import (
    best_draft_length,
    best_draft_length_is_certain,
    first_draft_threshold,
    speedup,
    step_points,
    step_time_error,
    uniform_union,
)
from moespec.files import write_json

# Seed 000's grid of 11 acceptances (the same as `moespec staircase`'s default).
ACCEPTANCE_GRID = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98)
VERIFY_TIMES = ("measured", "fitted")  # the versions of τ̂ (module docstring)
PLAN_FORMAT = "moespec-plan"


class VerifyFit:
    """τ(n) = t_0 + c_t n + B(n) / β (eq. 5), least squares with coefficients >= 0."""

    def fit(self, n_tokens, expert_bytes, seconds) -> "VerifyFit":
        columns = np.column_stack([np.ones(len(n_tokens)), n_tokens, expert_bytes]).astype(float)
        seconds = np.asarray(seconds, dtype=float)
        best = None
        # Non-negative least squares, exactly: its optimum is the unconstrained fit on some
        # subset of the terms, so the best fit over every non-empty subset whose coefficients
        # are all >= 0 is it. t_0 may drop out too: a time that grows from near zero would
        # otherwise leave only a constant (every fit holding t_0 with a slope negative in t_0).
        for used in itertools.chain.from_iterable(
            itertools.combinations((0, 1, 2), r) for r in range(1, 4)
        ):
            used = list(used)
            # each column scaled to unit norm first: bytes (~1e8) beside ones and n left the
            # solve ill-conditioned (relative errors of 5e-9 with some LAPACK builds)
            scale = np.linalg.norm(columns[:, used], axis=0)
            scale[scale == 0] = 1.0  # an all-zero column (no bytes given) stays as it is
            coef, *_ = np.linalg.lstsq(columns[:, used] / scale, seconds, rcond=None)
            coef = coef / scale
            if (coef < 0).any():
                continue
            residual = float(((columns[:, used] @ coef - seconds) ** 2).sum())
            if best is None or residual < best[0]:
                full = np.zeros(3)
                full[used] = coef
                best = (residual, full)
        self.fixed_, self.per_token_, self.seconds_per_byte_ = best[1]
        return self

    def predict(self, n_tokens, expert_bytes) -> np.ndarray:
        n_tokens, expert_bytes = np.asarray(n_tokens, float), np.asarray(expert_bytes, float)
        return self.fixed_ + self.per_token_ * n_tokens + self.seconds_per_byte_ * expert_bytes


def verify_prediction(n_tokens, expert_bytes, seconds):
    """(τ̂(n) at every n, the fit, ε): the fit of the batched passes (n >= 2) where at least
    four are measured, with the one-token pass as measured (llama.cpp's vector path); with
    fewer, one fit over every n."""
    n_tokens, expert_bytes, seconds = list(n_tokens), list(expert_bytes), list(seconds)
    batched = [i for i, n in enumerate(n_tokens) if n >= 2]
    if len(batched) < 4:
        fit = VerifyFit().fit(n_tokens, expert_bytes, seconds)
        return (
            fit.predict(n_tokens, expert_bytes).tolist(),
            fit,
            leave_one_out_error(n_tokens, expert_bytes, seconds),
        )
    points = [[values[i] for i in batched] for values in (n_tokens, expert_bytes, seconds)]
    fit = VerifyFit().fit(*points)
    predicted = fit.predict(n_tokens, expert_bytes).tolist()
    for i, n in enumerate(n_tokens):
        if n < 2:
            predicted[i] = float(seconds[i])
    return predicted, fit, leave_one_out_error(*points)


def leave_one_out_error(n_tokens, expert_bytes, seconds) -> float:
    """ε: the median relative error of the fit at each n, fitted without that n."""
    errors = []
    for i in range(len(n_tokens)):
        keep = [j for j in range(len(n_tokens)) if j != i]
        fit = VerifyFit().fit(
            [n_tokens[j] for j in keep], [expert_bytes[j] for j in keep], [seconds[j] for j in keep]
        )
        predicted = float(fit.predict([n_tokens[i]], [expert_bytes[i]])[0])
        errors.append(abs(predicted - seconds[i]) / seconds[i])
    return statistics.median(errors)


def gguf_experts(path: Path) -> dict:
    """From a GGUF file: experts per layer N, experts per token m, and w_l, the bytes of one
    expert (gate, up and down) of each MoE layer in the file's weight type."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = _field(reader, "general.architecture")
    experts = _field(reader, f"{arch}.expert_count")
    top_k = _field(reader, f"{arch}.expert_used_count")
    layers: dict[int, int] = {}
    for tensor in reader.tensors:
        if tensor.name.endswith("_exps.weight"):
            layer = int(tensor.name.split(".")[1])
            layers[layer] = layers.get(layer, 0) + int(tensor.n_bytes) // experts
    if not layers:
        raise ValueError(f"{path} has no expert tensors: llama.cpp's MoE plan needs an MoE model")
    return {
        "architecture": arch,
        "num_experts": experts,
        "top_k": top_k,
        "layers": sorted(layers),
        "expert_bytes": [layers[layer] for layer in sorted(layers)],
    }


def _field(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        raise ValueError(f"GGUF metadata has no {key!r}")
    value = field.parts[field.data[0]]
    return bytes(value).decode() if field.types[0].name == "STRING" else int(value[0])


def routing_union(
    experts: dict, max_n: int, model_dir=None, trace_path=None, documents: int = 24
) -> tuple:
    """(U [L, max_n], source): from moespec's trace of model_dir (on `documents` files of
    the embedded corpus), a trace file, or uniform routing."""
    from moespec.routing.reuse import document_statistics, estimate

    if trace_path is not None:
        from moespec.routing.store import read_trace

        trace, source = read_trace(trace_path), f"trace {trace_path}"
    elif model_dir is not None:
        from moespec.calibrate.plan import stdlib_documents
        from moespec.models import load_model
        from moespec.routing.record import record_trace

        model, tokenizer = load_model(model_dir, dtype="bf16")
        trace = record_trace(model, tokenizer, stdlib_documents(documents), truncate="right")
        source = f"moespec's trace of {model_dir} on {documents} files of the embedded corpus"
        del model
    else:
        n, m = experts["num_experts"], experts["top_k"]
        union = [[uniform_union(n, m, k) for k in range(1, max_n + 1)] for _ in experts["layers"]]
        return np.array(union, dtype=float), "uniform routing"
    if trace.num_experts != experts["num_experts"] or trace.num_layers != len(experts["layers"]):
        raise ValueError(f"the routing trace ({source}) is not of this GGUF's model")
    return estimate(document_statistics(trace, max_n), bootstrap=0).union, source


def greedy_acceptance(target, draft, tokens, positions: int = 512) -> float:
    """The share of positions of the text where the draft's greedy token equals the target's
    (both teacher forced on the same text): the geometric acceptance of greedy drafting."""
    tokens = list(tokens[:positions])
    target.reset()
    draft.reset()
    agree = 0
    for start in range(0, len(tokens), 64):
        chunk = tokens[start : start + 64]
        ours, theirs = target.forward(chunk).argmax(axis=1), draft.forward(chunk).argmax(axis=1)
        agree += int((ours == theirs).sum())
    total = len(tokens)
    return agree / total


def llamacpp_flags(k: int, draft_gguf: Path | None) -> dict:
    """The decision in llama.cpp's terms (llama-server / llama-speculative / llama-cli)."""
    if k == 0 or draft_gguf is None:
        return {"speculate": False, "draft_length": 0, "args": []}
    return {
        "speculate": True,
        "draft_length": k,
        "args": [
            "--spec-draft-model", str(draft_gguf),
            "--spec-draft-n-max", str(k), "--spec-draft-n-min", str(k),
            "--spec-draft-p-min", "0",
        ],
        # before the rename (llama.cpp removed these two; p-min kept its old name as an alias)
        "older_builds": [
            "-md", str(draft_gguf), "--draft-max", str(k), "--draft-min", str(k),
            "--draft-p-min", "0",
        ],
    }  # fmt: skip


def staircase(step_times: list[float], epsilon: float, grid=ACCEPTANCE_GRID) -> dict:
    delta = float(step_time_error(epsilon)) if epsilon < 1 else float("inf")
    by_acceptance = {}
    for a in grid:
        k = best_draft_length(step_times, a)
        by_acceptance[str(a)] = {
            "best_draft_length": k,
            "speedup": float(speedup(step_times, a, k)),
            "certain": bool(delta < 1 and best_draft_length_is_certain(step_times, a, delta)),
        }
    return {
        "step_points": [float(p) for p in step_points(step_times)],
        "first_draft_threshold": float(first_draft_threshold(step_times)),
        "step_time_error": delta,
        "by_acceptance": by_acceptance,
    }


def llamacpp_plan(
    out_dir: Path,
    *,
    gguf: Path,
    draft_gguf: Path | None = None,
    model_dir: Path | None = None,
    trace_path: Path | None = None,
    tokens: list[int] | None = None,
    threads: int = 1,
    depth: int = 256,
    max_n: int = 9,
    verify_repeats: int = 10,
    acceptance: float | None = None,
    trace_documents: int = 24,
    verify_times: str = "measured",
    force: bool = False,
) -> dict:
    """Measure llama.cpp, fit, predict and write out_dir/plan.json (`engine: llamacpp`).
    tokens: held-out text (ids) for the passes and the acceptance; default: the embedded
    corpus's verify documents in the GGUF's own tokenizer. verify_times: the version of τ̂
    the decision follows (`VERIFY_TIMES`); the plan holds both."""
    if verify_times not in VERIFY_TIMES:
        raise ValueError(f"verify times are one of {', '.join(VERIFY_TIMES)}, got {verify_times}")
    started = time.perf_counter()
    plan_path = Path(out_dir) / "plan.json"
    if plan_path.exists() and not force:
        from moespec.files import OutputExistsError

        raise OutputExistsError(plan_path)
    experts = gguf_experts(gguf)
    union, source = routing_union(experts, max_n, model_dir, trace_path, trace_documents)
    expert_bytes = (np.asarray(experts["expert_bytes"])[:, None] * union).sum(axis=0)
    target = llamacpp.LlamaCpp(gguf, threads=threads)
    if tokens is None:
        from moespec.calibrate.plan import verify_documents

        text = "".join(d.text for d in verify_documents())
        tokens = target.llm.tokenize(text.encode(), add_bos=False, special=False)
    records = llamacpp.measure_verify(
        target, tokens, depth=depth, pass_sizes=range(1, max_n + 1), repeats=verify_repeats
    )
    measured = [r["median"] for r in records]
    n_tokens = list(range(1, max_n + 1))
    predicted, fit, epsilon = verify_prediction(n_tokens, expert_bytes, measured)
    draft_time, measured_acceptance = [0.0] * max_n, None
    if draft_gguf is not None:
        draft = llamacpp.LlamaCpp(draft_gguf, threads=threads)
        if draft.vocab_size != target.vocab_size:
            raise ValueError(f"the draft {draft_gguf} has another vocabulary than {gguf}")
        draft_time = llamacpp.measure_draft_time(
            draft, tokens, depth=depth, max_draft_length=max_n - 1
        )
        measured_acceptance = greedy_acceptance(target, draft, tokens[depth:])
    versions = {}
    for name, tau in (("measured", measured), ("fitted", predicted)):
        steps = [tau[k] + draft_time[k] for k in range(max_n)]
        versions[name] = {
            "verify_time": list(tau),
            "step_times": steps,
            "staircase": staircase(steps, epsilon),
        }
    step_times = versions[verify_times]["step_times"]
    chosen = acceptance if acceptance is not None else measured_acceptance
    decision = None
    if chosen is not None:
        k = best_draft_length(step_times, chosen)
        decision = {"acceptance": chosen, **llamacpp_flags(k, draft_gguf)}
    plan = {
        "format": PLAN_FORMAT,
        "engine": "llamacpp",
        "gguf": str(gguf),
        "draft_gguf": str(draft_gguf) if draft_gguf else None,
        "model": {k: experts[k] for k in ("architecture", "num_experts", "top_k", "expert_bytes")},
        "versions": llamacpp.versions(),
        "threads": threads,
        "depth": depth,
        "routing": {"source": source, "union_mean": union.mean(axis=0).tolist()},
        "expert_bytes_by_n": expert_bytes.tolist(),
        "verify_records": records,
        "measured_verify": {"llamacpp": measured},
        "fit": {
            "fixed_seconds": fit.fixed_,
            "seconds_per_token": fit.per_token_,
            "expert_bandwidth": 1 / fit.seconds_per_byte_ if fit.seconds_per_byte_ else None,
        },
        "bandwidth_error": epsilon,
        # one MoE kernel in llama.cpp, with a vector path for one row (τ(1) as measured)
        "kernel": {"crossover": None, "dedup_kernel": None, "one_row": "measured"},
        "verify_times": verify_times,  # the version below the decision follows
        "verify_time": versions[verify_times]["verify_time"],
        "draft_time": draft_time,
        "step_times": step_times,
        "staircase": versions[verify_times]["staircase"],
        "tau_versions": versions,
        "measured_acceptance": measured_acceptance,
        "decision": decision,
        "seconds": time.perf_counter() - started,
    }
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    write_json(plan_path, plan, force=force)
    return plan
