"""A plan's speculative decision in the terms of the engines users scale out on: vLLM's
`speculative_config`, SGLang's server flags and llama.cpp's draft flags, each with the saving
the plan predicts for it.

    timing = read_timing("moespec-plan/plan.json")
    document = export_settings(timing, "vllm", acceptance=0.8)

The decision is the plan's: k*(a) on its step times V(k) (seed 000 Sec. 3.3), with the
per-token time of plain decoding, V(0), against that of speculation, V(k) / G_a(k). Prompt
lookup is charged no draft time (moespec's lookup costs O(k) per proposal, far below a pass),
so V(k) = tau(k + 1); a draft model is charged the h(k) the plan measured for it. The times
are those of the engine the plan timed (moespec's, or llama.cpp's for `--engine llamacpp`
plans) on the machine that timed them: the export says which, and refuses a plan of another
model, weights kind, engine version or machine where the plan records them and the caller
or this machine tells what they are here.

Everything from `Timing` to the document is pure; `read_timing`, `facts_here` and
`write_export` touch files and the machine.
"""

from dataclasses import dataclass
from pathlib import Path

from moespec.costmodel import (
    best_draft_length,
    best_draft_length_is_certain,
    expected_tokens,
    speedup,
    step_time_error,
)
from moespec.errors import SettingError, setting
from moespec.plan import facts_here as plan_facts_here
from moespec.plan import mismatch

TARGETS = ("vllm", "sglang", "llamacpp")
DRAFTERS = ("lookup", "model")  # prompt lookup in the context, or a draft checkpoint
EXPORT_FORMAT = "moespec-export/1"
# moespec's PromptLookupDrafter: the longest suffix of 1..3 tokens that occurred before
LOOKUP_NGRAM = (1, 3)
LLAMACPP_PLAN_FORMAT = "moespec-plan"  # `moespec.calibrate.llamacpp_plan` writes it


@dataclass(frozen=True)
class Timing:
    """What a plan decides a draft length from, read from either kind of plan file."""

    engine: str  # the engine the plan timed: "moespec" or "llamacpp"
    verify_time: list[float]  # tau(n), n = 1..n_max
    draft_time: list[float]  # h(k) of the plan's draft model, k = 0..n_max - 1
    draft: str | None  # that draft (a checkpoint or a GGUF); None: the plan measured none
    acceptance: float | None  # the draft's acceptance as the plan measured it
    bandwidth_error: float  # epsilon, which bounds how far V(k) may be off
    facts: dict  # what the plan was made with: model, weights, engine, machine (as recorded)
    where: str = "plan"
    # tau_hat_B(k) of a pass of B sequences, k = 0..: the plan's batch table (None: absent)
    batch_verify: dict[int, list[float]] | None = None


@dataclass(frozen=True)
class Decision:
    """k*(a) for one drafter, and the per-token times it is predicted to give."""

    drafter: str
    acceptance: float
    draft_length: int
    plain_time: float  # seconds per token without speculation, V(0)
    token_time: float  # seconds per token with k = draft_length, V(k) / G_a(k)
    speedup: float
    certain: bool  # epsilon cannot move k*

    @property
    def saving(self) -> float:
        return 1 - self.token_time / self.plain_time


# ------------------------------------------------------------------ reading a plan


def timing_of_plan(plan, where: str = "plan") -> Timing:
    """The timing of a moespec `Plan` (its chosen kernel's tau(n) and the draft it measured)."""
    measured_draft = plan.draft_dir is not None and any(h > 0 for h in plan.draft_time)
    return Timing(
        engine="moespec",
        verify_time=list(plan.verify_time),
        draft_time=list(plan.draft_time),
        draft=plan.draft_dir if measured_draft else None,
        acceptance=None,  # a moespec plan times the draft, not its acceptance
        bandwidth_error=plan.bandwidth_error,
        facts=plan.facts(),
        where=where,
        batch_verify=None if plan.batch is None else dict(plan.batch.verify_time),
    )


def timing_of_llamacpp(data: dict, where: str = "plan") -> Timing:
    """The timing of a llama.cpp plan (`moespec plan --engine llamacpp`), its fields checked."""
    verify = _floats(data, "verify_time", where)
    draft_time = _floats(data, "draft_time", where)
    if len(draft_time) != len(verify):
        raise ValueError(f"{where}: draft_time must hold one time per verify_time")
    acceptance = data.get("measured_acceptance")
    if acceptance is not None and not _fraction(acceptance):
        raise ValueError(f"{where}: measured_acceptance must be a number in [0, 1) or null")
    draft = data.get("draft_gguf")
    if draft is not None and not isinstance(draft, str):
        raise ValueError(f"{where}: draft_gguf must be a path or null")
    versions = data.get("versions")
    model = data.get("model")
    if not isinstance(versions, dict) or not isinstance(model, dict):
        raise ValueError(f"{where}: versions and model must be objects")
    return Timing(
        engine="llamacpp",
        verify_time=verify,
        draft_time=draft_time,
        draft=draft,
        acceptance=acceptance,
        bandwidth_error=_number(data, "bandwidth_error", where),
        facts={
            "model": {k: model.get(k) for k in ("num_experts", "top_k")},
            "weights": None,  # the GGUF's own weight type, not a moespec weights kind
            "engine": {k: versions.get(k) for k in ("llama_cpp_python", "llama_cpp")},
            "machine": None,  # not recorded by llama.cpp plans
        },
        where=where,
    )


def _floats(data: dict, key: str, where: str) -> list[float]:
    values = data.get(key)
    if not isinstance(values, list) or not values or not all(_real(v) and v >= 0 for v in values):
        raise ValueError(f"{where}: {key} must be a non-empty list of seconds >= 0")
    if key == "verify_time" and not all(v > 0 for v in values):
        raise ValueError(f"{where}: verify_time must be a list of positive seconds")
    return [float(v) for v in values]


def _number(data: dict, key: str, where: str) -> float:
    if not _real(data.get(key)):
        raise ValueError(f"{where}: {key} must be a number")
    return float(data[key])


def _real(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _fraction(value) -> bool:
    return _real(value) and 0 <= value < 1


def read_timing(path) -> Timing:
    """The timing of a plan file: moespec's (`moespec.plan`, schema checked) or llama.cpp's."""
    from moespec.plan import load_plan, read_plan_json

    path = Path(path)
    data = read_plan_json(path)
    if isinstance(data, dict) and data.get("format") == LLAMACPP_PLAN_FORMAT:
        if data.get("engine") != "llamacpp":
            raise ValueError(f"{path}: engine must be 'llamacpp' in a {LLAMACPP_PLAN_FORMAT}")
        return timing_of_llamacpp(data, str(path))
    return timing_of_plan(load_plan(path), str(path))  # schema errors name the field


# ------------------------------------------------------------------ checking a plan


def facts_here(engine: str) -> dict:
    """This machine's CPU and the versions of `engine` installed here (None: not installed)."""
    here = plan_facts_here()
    if engine != "moespec":
        here["engine"] = _llamacpp_versions()
    return here


def _llamacpp_versions() -> dict | None:
    try:
        from moespec.calibrate.llamacpp import versions
    except ImportError:
        return None
    try:
        found = versions()
    except ImportError:  # llama-cpp-python absent: its version cannot be told here
        return None
    return {k: found.get(k) for k in ("llama_cpp_python", "llama_cpp")}


def check_fits(timing: Timing, here: dict) -> None:
    """Refuse, in one line, a plan whose times are not of the model, weights, engine or
    machine that `here` describes: its k* was decided on another clock."""
    reason = mismatch(timing.facts, here)
    if reason is not None:
        raise ValueError(f"{timing.where} was timed for {reason}; plan again here")


# ------------------------------------------------------------------ the decision


def default_drafter(timing: Timing) -> str:
    """The draft model when the plan measured one, else prompt lookup."""
    return "model" if timing.draft is not None else "lookup"


def step_times(timing: Timing, drafter: str) -> list[float]:
    """V(k) = tau(k + 1) + h(k): h of the plan's draft model, none for prompt lookup."""
    if drafter == "lookup":
        return list(timing.verify_time)
    if timing.draft is None:
        raise SettingError(
            f"{timing.where} measured no draft model's times h(k): plan with a draft, or "
            f"export {setting('drafter', 'lookup')}"
        )
    return [t + h for t, h in zip(timing.verify_time, timing.draft_time, strict=True)]


def decide(timing: Timing, drafter: str, acceptance: float | None = None) -> Decision:
    """k*(a) at the given acceptance, else at the draft's as the plan measured it."""
    if drafter not in DRAFTERS:
        raise SettingError(f"unknown drafter {drafter!r}: {setting('drafter', 'lookup')} or model")
    if acceptance is None and drafter == "model":
        acceptance = timing.acceptance
    if acceptance is None:
        raise SettingError(
            f"{timing.where} records no measured acceptance for {drafter} drafting: give "
            f"{setting('acceptance')} (the share of drafted tokens accepted, 0 <= a < 1)"
        )
    if not _fraction(acceptance):
        raise SettingError(f"{setting('acceptance')} must be in [0, 1), got {acceptance!r}")
    steps = step_times(timing, drafter)
    k = best_draft_length(steps, acceptance)
    delta = step_time_error(timing.bandwidth_error) if timing.bandwidth_error < 1 else 1
    return Decision(
        drafter=drafter,
        acceptance=float(acceptance),
        draft_length=k,
        plain_time=steps[0],
        token_time=steps[k] / expected_tokens(acceptance, k),
        speedup=float(speedup(steps, acceptance, k)),
        certain=bool(delta < 1 and best_draft_length_is_certain(steps, acceptance, delta)),
    )


def decide_by_batch(timing: Timing, decision: Decision) -> list[Decision]:
    """k*(a, B) at the decision's acceptance for each batch size of the plan's table, on each
    sequence's share of the batch's pass, V_B(k) = tau_hat_B(k) / B (+ h(k), the sequence's
    own drafting, for a draft model as moespec's engine drafts each sequence apart)."""
    if not timing.batch_verify:
        return []
    out = []
    for batch, verify in sorted(timing.batch_verify.items()):
        draft = timing.draft_time if decision.drafter == "model" else [0.0] * len(verify)
        steps = [t / batch + h for t, h in zip(verify, draft, strict=False)]
        k = best_draft_length(steps, decision.acceptance)
        out.append(
            Decision(
                drafter=decision.drafter,
                acceptance=decision.acceptance,
                draft_length=k,
                plain_time=steps[0],
                token_time=steps[k] / expected_tokens(decision.acceptance, k),
                speedup=float(speedup(steps, decision.acceptance, k)),
                certain=False,  # the table is predicted beyond the sizes the fits saw
            )
        )
    return out


def batch_schedule(sizes: list[int], lengths: list[int]) -> list[list[int]]:
    """vLLM's `num_speculative_tokens_per_batch_size`: [first, last, K] ranges from 1, each
    size's K up to the next size, equal neighbours merged; vLLM keeps the last K beyond."""
    ranges = []
    for i, (size, k) in enumerate(zip(sizes, lengths, strict=True)):
        first = 1 if i == 0 else size
        last = sizes[i + 1] - 1 if i + 1 < len(sizes) else size
        if ranges and ranges[-1][2] == k:
            ranges[-1][1] = last
        else:
            ranges.append([first, last, k])
    return ranges


# ------------------------------------------------------------------ engine settings


def vllm_config(
    decision: Decision,
    draft: str | None,
    by_batch: list[Decision] | None = None,
    sizes: list[int] | None = None,
) -> dict | None:
    """vLLM's `speculative_config` (None: do not speculate, pass none). With the plan's
    batch table (`by_batch`, one decision per size of `sizes`), its per-batch-size draft
    length `num_speculative_tokens_per_batch_size`, `num_speculative_tokens` the largest."""
    k = decision.draft_length
    schedule = None
    if by_batch:
        lengths = [d.draft_length for d in by_batch]
        schedule = batch_schedule(list(sizes), lengths)
        k = max(lengths)
    if k == 0:
        return None
    if decision.drafter == "lookup":
        low, high = LOOKUP_NGRAM
        config = {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": low,
            "prompt_lookup_max": high,
        }
    else:
        config = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    if schedule is not None and len(schedule) > 1:
        config["num_speculative_tokens_per_batch_size"] = schedule
    return config


def sglang_args(decision: Decision, draft: str | None) -> list[str]:
    """SGLang's server flags. Its draft-token count is the verify width, the k drafted tokens
    and the one they follow (k + 1, as the plan's tau(k + 1)); one branch per step (top-k and
    n-gram breadth 1), as the plan times a chain of k."""
    k = decision.draft_length
    if k == 0:
        return []
    if decision.drafter == "lookup":
        return [
            "--speculative-algorithm", "NGRAM",
            "--speculative-num-draft-tokens", str(k + 1),
            "--speculative-ngram-min-bfs-breadth", "1",
            "--speculative-ngram-max-bfs-breadth", "1",
        ]  # fmt: skip
    return [
        "--speculative-algorithm", "STANDALONE",
        "--speculative-draft-model-path", str(draft),
        "--speculative-num-steps", str(k),
        "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", str(k + 1),
    ]  # fmt: skip


def llamacpp_args(decision: Decision, draft: str | None) -> dict:
    """llama.cpp's draft flags (`moespec.calibrate.llamacpp_plan.llamacpp_flags`): exactly k
    drafted tokens. Its n-gram drafters match one fixed n-gram size, not moespec's lookup, so
    only a draft model is exported for it."""
    from moespec.calibrate.llamacpp_plan import llamacpp_flags

    if decision.drafter == "lookup":
        raise SettingError(
            "llama.cpp's n-gram drafters are not moespec's prompt lookup: export "
            f"{setting('drafter', 'model')} for llama.cpp"
        )
    flags = llamacpp_flags(decision.draft_length, draft)
    return {"args": flags["args"], "older_builds": flags.get("older_builds", [])}


def check_draft(target: str, drafter: str, draft: str | None) -> None:
    """The draft as the target engine loads it: a GGUF file for llama.cpp, a checkpoint
    (folder or hub name) for vLLM and SGLang."""
    if drafter != "model":
        return
    if draft is None:
        raise SettingError(f"no draft model to export: give {setting('draft')}")
    gguf = draft.lower().endswith(".gguf")
    if target == "llamacpp" and not gguf:
        raise SettingError(
            f"llama.cpp loads a GGUF draft, not {draft}: give {setting('draft', 'FILE.gguf')}"
        )
    if target != "llamacpp" and gguf:
        raise SettingError(
            f"{target} loads the draft's checkpoint, not {draft}: give {setting('draft')}"
        )


def export_settings(
    timing: Timing,
    target: str,
    *,
    drafter: str | None = None,
    acceptance: float | None = None,
    draft: str | None = None,
) -> dict:
    """The export document: `target`'s settings for k*(a), and the prediction beside them."""
    if target not in TARGETS:
        raise SettingError(f"unknown export target {target!r}: one of {', '.join(TARGETS)}")
    drafter = drafter or default_drafter(timing)
    draft = draft if draft is not None else timing.draft
    decision = decide(timing, drafter, acceptance)
    by_batch = decide_by_batch(timing, decision) if target == "vllm" else []
    if decision.draft_length > 0 or any(d.draft_length for d in by_batch):
        check_draft(target, drafter, draft)
    if target == "vllm":
        sizes = sorted(timing.batch_verify or ())
        settings = {"speculative_config": vllm_config(decision, draft, by_batch, sizes)}
    elif target == "sglang":
        settings = {"args": sglang_args(decision, draft)}
    else:
        settings = llamacpp_args(decision, draft)
    predicted = prediction(decision, timing)
    if by_batch:
        predicted["by_batch_size"] = [
            {"batch_size": size, **_predicted_step(d)}
            for size, d in zip(sorted(timing.batch_verify), by_batch, strict=True)
        ]
    return {
        "format": EXPORT_FORMAT,
        "engine": target,
        "plan": timing.where,
        **settings,
        "predicted": predicted,
    }


def _predicted_step(decision: Decision) -> dict:
    return {
        "draft_length": decision.draft_length,
        "ms_per_token_plain": decision.plain_time * 1e3,
        "ms_per_token": decision.token_time * 1e3,
        "speedup": decision.speedup,
    }


def prediction(decision: Decision, timing: Timing) -> dict:
    """The saving beside the settings, and whose clock it was predicted on."""
    return {
        "drafter": decision.drafter,
        "acceptance": decision.acceptance,
        "draft_length": decision.draft_length,
        "speculate": decision.draft_length > 0,
        "ms_per_token_plain": decision.plain_time * 1e3,
        "ms_per_token": decision.token_time * 1e3,
        "speedup": decision.speedup,
        "saving": decision.saving,
        "certain": decision.certain,  # False: the fit's error epsilon could move k*
        "timed_by": timing.engine,
        "timed_on": timing.facts.get("machine"),
    }


def write_export(document: dict, path, *, force: bool = False) -> Path:
    """Write the document atomically; an existing file only with force."""
    from moespec.files import write_json

    return write_json(path, document, force=force)
