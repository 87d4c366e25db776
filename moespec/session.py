"""One generation as `moespec generate` runs it, composed from the library's parts.

`generate_text(GenerateSettings(prompt=...))` loads the checkpoint (default: the embedded demo
target, drafted by its demo draft), reads the plan (which builds the kernel policy and the
draft policy), fits the prompt to the context, builds speculation and the offload engine, and
decodes, streaming text through `on_text`; with `compare_plain` it also decodes plainly in
paired rounds (`moespec.decoding.compare`). It returns a `GenerateResult`.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

from moespec.errors import SettingError, setting
from moespec.plan import Plan


@dataclass(kw_only=True)
class OffloadSettings:
    """Where the target's experts live when memory does not hold them all: the settings of
    `moespec generate` and `moespec serve`, by the same names, checked in one place
    (`check_offload`). Without `offload` (a policy's name) every expert stays in memory."""

    offload: str | None = None
    expert_cache_ratio: float | None = None
    expert_cache_bytes: int | None = None
    offload_device: str = "auto"
    offload_fit: str | None = None
    # the disk tier: experts read from a converted model's file into a RAM cache of this size
    # (bytes, "6G", or "auto": available memory less the dense weights and a margin)
    memory_budget: int | str | None = None

    def check_offload(self) -> None:
        """Wrong settings whatever the model fail here, before it loads; a policy without a
        budget gets the default (a quarter of the expert bytes), a memory budget its bytes."""
        budget = self.expert_cache_ratio is not None or self.expert_cache_bytes is not None
        if self.offload is None:
            if budget or self.memory_budget is not None:
                raise SettingError(
                    f"{setting('expert_cache_ratio')}/{setting('expert_cache_bytes')}/"
                    f"{setting('memory_budget')} need {setting('offload', 'POLICY')}"
                )
            return
        from moespec.offload import make_policy

        make_policy(self.offload)  # an unknown name fails here
        if self.memory_budget is not None:
            self.check_disk_tier(budget)
            return
        if not budget:
            self.expert_cache_ratio = 0.25
        ratio, nbytes = self.expert_cache_ratio, self.expert_cache_bytes
        if ratio is not None and not ratio > 0:
            raise SettingError(f"{setting('expert_cache_ratio')} must be > 0, got {ratio}")
        if nbytes is not None and nbytes < 0:
            raise SettingError(f"{setting('expert_cache_bytes')} must be >= 0, got {nbytes}")

    def check_disk_tier(self, budget: bool) -> None:
        from moespec.offload.engine.disk import parse_size

        if budget:
            raise SettingError(
                f"{setting('memory_budget')} sizes the disk tier's RAM cache: it does not take "
                f"{setting('expert_cache_ratio')}/{setting('expert_cache_bytes')}"
            )
        if self.offload_device not in ("auto", "cpu"):
            raise SettingError(
                f"{setting('memory_budget')} reads experts from disk into RAM: it does not "
                f"take {setting('offload_device', self.offload_device)}"
            )
        if self.memory_budget != "auto":
            self.memory_budget = parse_size(self.memory_budget)

    def packs_experts(self, dtype: str) -> bool:
        """Whether the model loads with its experts packed (`load_model`'s pack_experts): in
        memory always; offloaded where the engine copies the packed layout."""
        from moespec.offload.engine.tiers import keeps_packed_experts

        return self.offload is None or keeps_packed_experts(self.offload_device, dtype)


@dataclass
class GenerateSettings(OffloadSettings):
    """The settings of one generation (those of `moespec generate`, by the same names; the
    offload settings are `OffloadSettings`', keyword-only)."""

    prompt: str
    model: str | None = None
    max_tokens: int = 128
    draft: str | None = None  # None: auto with the demo draft on the demo model, else none
    draft_length: int | str = "auto"
    max_draft_length: int = 8
    compare_plain: bool = False
    rounds: int = 3
    kernel: str = "auto"
    crossover: int | None = None
    plan: str | None = None
    dtype: str = "bf16"
    weights: str | None = None  # "int8" or "int8-experts" (`models.load_model`); None: dtype
    batch_invariant: bool = True
    compile: str = "off"  # one-token steps by torch.compile: "auto", "on" or "off"
    truncate: str = "none"
    context: int | None = None  # positions; None: the model's, capped to what memory holds
    stop_repeats: int = 8
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    threads: int | None = None
    remember: bool = True  # seed auto from measurements remembered by earlier runs (--no-cache)

    def check(self) -> None:
        """Settings that are wrong whatever the model: fail before it loads."""
        from moespec.decoding import KernelPolicy

        if self.draft_length != "auto" and (
            not isinstance(self.draft_length, int) or self.draft_length < 0
        ):
            raise SettingError(
                f"{setting('draft_length')} must be an integer >= 0 or 'auto', "
                f"got {self.draft_length!r}"
            )
        KernelPolicy(self.kernel, self.crossover)
        self.check_offload()

    def check_offload(self) -> None:
        if self.weights is not None and self.offload is not None:
            raise SettingError(
                f"{setting('weights', self.weights)} runs in memory: it does not take "
                f"{setting('offload')}"
            )
        super().check_offload()


@dataclass
class GenerateResult:
    """What a generation made: the shown run's records and totals, and notes on the run."""

    model: str
    draft: str | None
    prompt: str
    prompt_tokens: list[int]
    given_prompt_tokens: int  # before truncation
    tokens: list[int]
    text: str
    threads: dict
    weights: dict  # formats and product paths (`kernels.cpu.weight_paths`)
    batch_invariant: bool
    summary: dict  # `decoding.summarize` (+ offload, speedup and compare when measured)
    compile: dict = field(default_factory=dict)  # "target", "draft/NAME": compile_report
    # "target", "draft/NAME": whether passes run natively (Transformer.native_report)
    native: dict = field(default_factory=dict)
    records: list = field(default_factory=list)
    # weights_bytes, cache_bytes, context and this process's resident memory (models.memory)
    memory: dict = field(default_factory=dict)

    @property
    def speculative(self) -> bool:
        return self.draft is not None

    def to_dict(self) -> dict:
        """The JSON object of `moespec generate --json`."""
        return {
            "model": self.model,
            "draft": self.draft,
            "prompt": self.prompt,
            "prompt_tokens": self.prompt_tokens,
            "tokens": self.tokens,
            "text": self.text,
            "threads": self.threads,
            "weights": self.weights,
            "batch_invariant": self.batch_invariant,
            "compile": self.compile,
            "native_pass": self.native,
            "memory": self.memory,
            **self.summary,
            "steps": [r.to_dict() for r in self.records],
        }


def generate_text(
    settings: GenerateSettings,
    *,
    on_prompt: Callable[[str], None] | None = None,
    on_text: Callable[[str], None] | None = None,
    on_note: Callable[[str], None] | None = None,
) -> GenerateResult:
    """Decode as the settings say. on_prompt: called once with the prompt as decoded (its
    kept part when truncated); on_text: each piece of the shown run's text as it streams;
    on_note: a line about how the run goes (an offload budget that holds every expert)."""
    import torch

    from moespec.decoding import Sampler
    from moespec.decoding.setup import draft_name
    from moespec.demo import describe
    from moespec.kernels.cpu import weight_paths
    from moespec.models import StreamingDetokenizer, load_model
    from moespec.models.compiled import capture, compile_report
    from moespec.models.context import fit_context

    settings.check()
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    Sampler(settings.temperature, settings.top_p, settings.seed)  # bad values fail here
    torch.manual_seed(settings.seed)
    model_dir, draft = model_and_draft(settings.model, settings.draft)
    footprint, context = memory_plan(settings, model_dir)
    model, tokenizer = load_model(
        model_dir,
        dtype=settings.dtype,
        pack_experts=settings.packs_experts(settings.dtype),
        weights=settings.weights,
    )
    model.batch_invariant = settings.batch_invariant
    capture(model, settings.compile)
    kernels = Kernels.of(settings, model)
    prompt = tokenizer.encode(settings.prompt)
    if not prompt:
        raise ValueError("the prompt encodes to no tokens")
    given = len(prompt)
    prompt = fit_context(
        prompt, context or model.config, new_tokens=settings.max_tokens, truncate=settings.truncate
    )
    if on_prompt is not None:
        on_prompt(settings.prompt if len(prompt) == given else tokenizer.decode(prompt))
    make_speculation = speculation(settings, draft, model, tokenizer, prompt, kernels)
    for note in getattr(make_speculation, "notes", []):
        if on_note is not None:
            on_note(f"note: {note}")
    remembered = None
    if make_speculation is not None and settings.remember and settings.offload is None:
        from moespec.decoding.remembered import Remembered

        remembered = Remembered.open(
            model_dir,
            weights=settings.weights,
            dtype=settings.dtype,
            threads=torch.get_num_threads(),
            on_note=on_note,
        )
        make_speculation = remembering(make_speculation, remembered)
    arms = Arms(settings, model, prompt, kernels, make_speculation, on_note)
    stream = StreamingDetokenizer(tokenizer)

    def show(record) -> None:
        piece = stream.add(record.tokens)
        if on_text is not None:
            on_text(piece)

    records, comparison = arms.run(show)
    if on_text is not None:
        on_text(stream.flush())
    if remembered is not None and make_speculation.last is not None:
        remembered.take(make_speculation.last)
        remembered.save()
    tokens = [t for r in records for t in r.tokens]
    drafts = getattr(make_speculation, "models", {})
    models = {"target": model, **{f"draft/{name}": m for name, m in drafts.items()}}
    return GenerateResult(
        model=describe(model_dir),
        draft=draft_name(draft),
        prompt=settings.prompt,
        prompt_tokens=prompt,
        given_prompt_tokens=given,
        tokens=tokens,
        text=tokenizer.decode(tokens),
        threads=model.thread_plan(),
        weights=weight_paths(model.expert_format, model.dense_format, model.dtype),
        batch_invariant=model.batch_invariant,
        summary=arms.summary(records, comparison),
        records=records,
        compile={name: compile_report(m) for name, m in models.items()},
        native={name: m.native_report() for name, m in models.items()},
        memory=memory_report(footprint, context, len(prompt) + settings.max_tokens + 1),
    )


def memory_plan(settings: GenerateSettings, model_dir: str):
    """(footprint, context) of a run in memory: the weights and cache it will hold, refused
    before loading where they do not fit (moespec.models.memory); (None, setting) offloaded."""
    from moespec.models.memory import available_memory, fit_memory, model_footprint

    if settings.offload is not None:
        return None, settings.context
    footprint = model_footprint(model_dir, settings.dtype, settings.weights)
    context = fit_memory(footprint, settings.context, available_memory(), name=model_dir)
    return footprint, context


def memory_report(footprint, context: int | None, positions: int) -> dict:
    """generate --json's "memory": weights and cache bytes, the context, resident memory."""
    from moespec.models.memory import process_memory

    report = {"context": context, **process_memory()}
    if footprint is not None:
        report.update(
            weights_bytes=footprint.weights_bytes,
            cache_bytes=footprint.cache_bytes(min(positions, context or positions)),
            converted=footprint.converted,
        )
    return report


def model_and_draft(model: str | None, draft: str | None) -> tuple[str, str | None]:
    """The checkpoint and draft spec: the demo pair (drafted by `auto:` its demo draft)
    without a model; "none" as no draft."""
    if model is None:
        from moespec.demo import demo_paths

        model, demo_draft = map(str, demo_paths())
        if draft is None:
            draft = f"auto:{demo_draft}"
    return model, None if draft == "none" else draft


@dataclass
class Kernels:
    """A maker of a fresh kernel policy per generation: the plan's (at its crossover unless
    one is set) when there is a plan, else the setting's kernel and crossover."""

    kernel: str
    crossover: int | None = None
    plan: Plan | None = None

    @classmethod
    def of(cls, settings: GenerateSettings, model) -> "Kernels":
        plan = None
        if settings.plan is not None:
            from moespec.plan import load_plan

            plan = load_plan(settings.plan, model=model)
        return cls(settings.kernel, settings.crossover, plan)

    def __call__(self):
        if self.plan is not None:
            return self.plan.kernel_policy(self.kernel, self.crossover)
        from moespec.decoding import KernelPolicy

        return KernelPolicy(self.kernel, self.crossover)


def remembering(make, remembered):
    """`make` whose every speculation starts from the remembered measurements; `.last` is the
    latest made (the shown run's, whose measurements are remembered after it)."""

    def make_seeded():
        made = make()
        remembered.seed(made)
        make_seeded.last = made
        return made

    make_seeded.last = None
    make_seeded.__dict__.update({k: v for k, v in make.__dict__.items() if k != "last"})
    return make_seeded


def speculation(settings, draft, model, tokenizer, prompt, kernels):
    """A maker of fresh speculation state per generation (None without a draft)."""
    from moespec.decoding import Sampler
    from moespec.decoding.setup import greedy_reference, speculation_factory

    if not draft:
        return None
    sampler = Sampler(settings.temperature, settings.top_p, settings.seed)
    reference = None
    if draft.startswith("oracle") and sampler.greedy:  # in memory, untimed
        reference = greedy_reference(
            model, prompt, settings.max_tokens, kernels(), model.config.eos_token_ids
        )
    return speculation_factory(
        draft,
        draft_length=settings.draft_length,
        max_draft_length=settings.max_draft_length,
        plan=kernels.plan,
        target=model,
        tokenizer=tokenizer,
        sampler=sampler,
        prompt=prompt,
        max_tokens=settings.max_tokens,
        dtype=settings.dtype,
        reference=reference,
        seed=settings.seed,
        compile=settings.compile,
    )


class OffloadedExperts:
    """A loaded model's experts offloaded as `OffloadSettings` say, the cache budget decided
    once (`of`); `open(draft_length)` opens an offload engine over them
    (`moespec.offload.engine.open`): one per generation in `generate`, one for the server's
    life in `serve`."""

    def __init__(self, settings: OffloadSettings, model, budget_bytes: int | None):
        self.settings, self.model, self.budget_bytes = settings, model, budget_bytes

    @classmethod
    def of(
        cls,
        settings: OffloadSettings,
        model,
        speculative: bool,
        on_note: Callable[[str], None] | None = None,
    ) -> "OffloadedExperts | None":
        """The model's offloaded experts, or None where it runs in memory: no policy, or a
        cache budget that holds every expert (a note says so). A policy that plans without a
        draft is refused when decoding speculates; a disk budget below one layer's active
        experts is refused, one above what is available capped (a note says so)."""
        if settings.offload is None:
            return None
        from moespec.offload.engine.open import cache_budget, checked_policy

        checked_policy(settings.offload, speculative)
        if settings.memory_budget is not None:  # the disk tier: its RAM cache's bytes
            from moespec.offload.engine.disk import disk_budget

            budget, note = disk_budget(model, settings.memory_budget)
            if note is not None and on_note is not None:
                on_note(note)
            return cls(settings, model, budget)
        nbytes = settings.expert_cache_bytes
        budget, total = cache_budget(model, settings.expert_cache_ratio, nbytes)
        if budget < total:
            return cls(settings, model, nbytes)
        if on_note is not None:
            on_note(
                f"note: the expert cache ({budget} bytes) holds all {total} bytes of experts: "
                "running in memory"
            )
        return None

    def open(self, draft_length: int):
        """An offload engine for steps of `draft_length` drafted tokens (0: no speculation)."""
        from moespec.offload.engine.open import open_engine

        s = self.settings
        return open_engine(
            self.model,
            s.offload,
            s.expert_cache_ratio,
            draft_length,
            budget_bytes=self.budget_bytes,
            device=s.offload_device,
            fit_trace=s.offload_fit,
            disk=s.memory_budget is not None,
        )


def planned_draft_length(draft_length: int | str, max_draft_length: int) -> int:
    """The k an offload policy plans for: the fixed draft length, or k_max under auto."""
    return max_draft_length if draft_length == "auto" else draft_length


class Arms:
    """The speculative and the plain arm: each call of an arm is a fresh generation (sampler,
    kernel policy, drafters, offload cache); offload summaries are kept per arm."""

    def __init__(self, settings, model, prompt, kernels, make_speculation, on_note):
        self.settings, self.model, self.prompt = settings, model, prompt
        self.kernels, self.make_speculation = kernels, make_speculation
        self.speculative = make_speculation is not None
        self.offload_runs = {True: [], False: []}
        self.offloaded = OffloadedExperts.of(settings, model, self.speculative, on_note)
        self.draft_length = planned_draft_length(settings.draft_length, settings.max_draft_length)

    def _open_offload(self, speculative: bool):
        if self.offloaded is None:
            return None
        return self.offloaded.open(self.draft_length if speculative else 0)

    def arm(self, speculative: bool):
        from moespec.decoding import Sampler, generate
        from moespec.decoding.repetition import stop_repetition

        s = self.settings

        def decode(max_tokens: int):
            offload = self._open_offload(speculative)
            try:  # both arms stop alike at a loop (moespec.decoding.repetition)
                records = generate(
                    self.model,
                    self.prompt,
                    max_tokens=max_tokens,
                    sampler=Sampler(s.temperature, s.top_p, s.seed),
                    kernels=self.kernels(),
                    drafter=self.make_speculation() if speculative else None,
                    stop_tokens=self.model.config.eos_token_ids,
                    offload=offload,
                )
                yield from stop_repetition(records, s.stop_repeats)
            finally:
                if offload is not None:
                    self.offload_runs[speculative].append(offload.summary())
                    offload.close()

        return decode

    def run(self, show) -> tuple[list, object]:
        """(the shown run's records, the Comparison or None)."""
        from moespec.decoding.compare import compare_plain

        s = self.settings
        if s.compare_plain:
            comparison, records = compare_plain(
                self.arm(self.speculative),
                self.arm(False),
                s.max_tokens,
                rounds=s.rounds,
                on_speculative=show,
            )
            return records, comparison
        records = []
        for record in self.arm(self.speculative)(s.max_tokens):
            records.append(record)
            show(record)
        return records, None

    def summary(self, records, comparison) -> dict:
        from moespec.decoding import summarize

        summary = summarize(records)
        runs = self.offload_runs[self.speculative]
        if runs:  # the shown run's: after the warm-up when comparing
            summary["offload"] = runs[1 if comparison else 0]
        if comparison is not None:
            compared = comparison.to_dict()
            summary["speedup"] = compared.pop("speedup")
            summary["plain_tokens_per_second"] = compared["plain_tokens_per_second"]
            summary["same_tokens_as_plain"] = compared["same_tokens_as_plain"]
            summary["compare"] = compared
        return summary
