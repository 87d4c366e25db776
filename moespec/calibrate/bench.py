"""The benchmark of one MoE layer's expert operation, both kernels, alone (seed 000 §2, App. E).

For each layer, kernel and pass size n it times the kernel on two kinds of expert ids: chosen
ids (U distinct experts among the n m slots, from heavy repetition to none), which let a fit
separate first reads from repeated ones, and recorded windows of a routing trace, which the
fits do not see and which score them. Every timed run follows a cache flush (a buffer larger
than the last-level cache); every raw sample is kept.

Raw timings are appended to a JSON-lines file as each case finishes: an interrupted run keeps
what it finished, and a rerun with the same settings resumes where it stopped.

Which code is timed: where the engine's passes run natively (moespec.models.native_step), the
slot and dedup kernels are the native pass's own expert operation (`NativeExperts`: the same
products, orders and rounding, with no library dispatch around them), so that the fits
describe what the engine runs; elsewhere the eager kernels (moespec.kernels). The header
says which ("expert_operation": "native"), so a run never resumes the other's timings.
"""

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from moespec.calibrate.ids import chosen_ids, distinct_count, distinct_levels
from moespec.calibrate.timing import FLUSH_BYTES, CacheFlusher, median_iqr, time_runs
from moespec.errors import SettingError, setting
from moespec.kernels import ExpertWeights, get_kernel
from moespec.kernels.invariance import batch_invariance
from moespec.models.native_step import KERNELS as NATIVE_KERNELS
from moespec.models.native_step import NativeExperts, experts_unsupported
from moespec.progress import Progress, using

FORMAT = "moespec-expert-op-bench/1"


@dataclass(frozen=True)
class Case:
    """One timed configuration. design: "chosen" (ids with `distinct` experts) or "window"
    (the `window`-th recorded window of n tokens)."""

    layer: int
    kernel: str
    n_tokens: int
    design: str
    distinct: int
    window: int = -1

    @property
    def key(self) -> str:
        parts = (self.layer, self.kernel, self.n_tokens, self.design, self.distinct, self.window)
        return "/".join(map(str, parts))


@dataclass
class BenchSettings:
    kernels: tuple[str, ...] = ("slot", "dedup")
    pass_sizes: tuple[int, ...] = tuple(range(1, 10))
    chosen_levels: int = 5  # values of U per pass size
    repeats: int = 7
    warmup: int = 2
    # bytes of the buffer touched before each timed run (0: none); None: the plan decides from
    # the model's size and this CPU's last-level cache (`calibrate.plan.engine_cache_state`),
    # a benchmark given None flushes FLUSH_BYTES
    flush_bytes: int | None = None
    seed: int = 0
    # time the products as the engine's verification passes run them by default: each row
    # with the bits it gets alone (`kernels.invariance`). Where a path has no batch-invariant
    # multi-row form, a pass of n rows reads its weights n times (fp32's oneDNN products on
    # an AVX-512/AMX Xeon: one row at a time), and a plan timed without it predicts far too
    # little growth with n; the native bf16 loops give every row its own bits either way
    batch_invariant: bool = True


class ExpertOpBenchmark:
    """experts: {decoder layer: ExpertWeights}; windows: {layer: {n: [W, n, m] ids}}."""

    def __init__(
        self,
        experts: dict[int, ExpertWeights],
        top_k: int,
        settings: BenchSettings | None = None,
        windows: dict[int, dict[int, np.ndarray]] | None = None,
        header: dict | None = None,
        native: bool | None = None,
    ):
        """native: time the native pass's expert operation for the slot and dedup kernels
        (True: refused in one line where these experts cannot take it; None: wherever they
        can; False: the eager kernels)."""
        self.experts = experts
        self.top_k = top_k
        self.settings = settings or BenchSettings()
        self.windows = windows or {}
        self.header = {
            "format": FORMAT,
            **(header or {}),
            "settings": asdict(self.settings),
            "top_k": top_k,
            "layers": sorted(experts),
        }
        device = next(iter(experts.values())).device
        if device.type != "cpu":  # a run on another device never resumes a CPU run
            self.header["device"] = str(device)
        for name in self.settings.kernels:
            get_kernel(name)  # unknown kernels fail before any timing
        self.native = _native_operations(experts, native)
        if self.native:
            self.header["expert_operation"] = "native"

    def cases(self) -> list[Case]:
        s = self.settings
        rng = np.random.default_rng(s.seed)
        cases = []
        for layer, experts in sorted(self.experts.items()):
            for n in s.pass_sizes:
                levels = distinct_levels(n, self.top_k, experts.num_experts, s.chosen_levels)
                windows = self.windows.get(layer, {}).get(n)
                for kernel in s.kernels:
                    cases += [Case(layer, kernel, n, "chosen", u) for u in levels]
                    if windows is not None:
                        cases += [
                            Case(layer, kernel, n, "window", distinct_count(w), i)
                            for i, w in enumerate(windows)
                        ]
        rng.shuffle(cases)  # spread slow drift of the machine over every configuration
        return cases

    def ids_for(self, case: Case) -> np.ndarray:
        if case.design == "window":
            return self.windows[case.layer][case.n_tokens][case.window]
        experts = self.experts[case.layer]
        rng = np.random.default_rng([self.settings.seed, case.layer, case.n_tokens, case.distinct])
        return chosen_ids(case.n_tokens, self.top_k, experts.num_experts, case.distinct, rng)

    def measure(self, case: Case, flush) -> dict:
        experts = self.experts[case.layer]
        device = experts.device
        generator = torch.Generator().manual_seed(case.n_tokens)
        x = torch.randn(case.n_tokens, experts.hidden_size, generator=generator)
        x = x.to(device=device, dtype=experts.dtype)
        ids = torch.as_tensor(self.ids_for(case), dtype=torch.long)
        weights = torch.softmax(torch.randn(ids.shape, generator=generator), dim=-1)
        ids, weights = ids.to(device), weights.to(device)
        if self.native and case.kernel in NATIVE_KERNELS:
            native, dedup = self.native[case.layer], case.kernel == "dedup"

            def run():
                return native(x, ids, weights, dedup)
        else:
            kernel = get_kernel(case.kernel)

            def run():
                return kernel(x, ids, weights, experts)

        with torch.inference_mode(), batch_invariance(self.settings.batch_invariant):
            samples = time_runs(
                run,
                repeats=self.settings.repeats,
                warmup=self.settings.warmup,
                flush=flush,
                device=device,
            )
        median, iqr = median_iqr(samples)
        return {
            **asdict(case),
            "key": case.key,
            "expert_bytes": experts.bytes_per_expert,
            "seconds": samples,
            "median": median,
            "iqr": iqr,
        }

    def run(self, raw_path: Path, *, progress: Progress | bool = True) -> list[dict]:
        """Time every case not already in `raw_path`; return all records (old and new).
        progress: a Progress to report into, or whether to show one (moespec.progress)."""
        raw_path = Path(raw_path)
        done = load_raw(raw_path, expect_header=self.header) if raw_path.exists() else []
        finished = {r["key"] for r in done}
        todo = [c for c in self.cases() if c.key not in finished]
        device = next(iter(self.experts.values())).device
        flush_bytes = self.settings.flush_bytes
        flush_bytes = FLUSH_BYTES if flush_bytes is None else flush_bytes
        flush = CacheFlusher(flush_bytes, device) if flush_bytes else None
        records = list(done)
        if raw_path.exists() and not raw_path.read_bytes().endswith(b"\n"):
            _drop_torn_line(raw_path)  # an interruption cut the last line short
        with open(raw_path, "a") as out, using(progress) as bar:
            bar.start("benchmarking the expert operation", total=len(todo), unit="cases")
            if out.tell() == 0:
                out.write(json.dumps({"header": self.header}) + "\n")
            for case in todo:
                record = self.measure(case, flush)
                out.write(json.dumps(record) + "\n")
                out.flush()
                records.append(record)
                bar.advance()
        return records


def _native_operations(experts: dict, native: bool | None) -> dict:
    """{layer: NativeExperts} when the native expert operation is to be timed, else {}."""
    if native is False:
        return {}
    why = next(filter(None, (experts_unsupported(e) for e in experts.values())), None)
    if why is not None:
        if native:
            raise SettingError(f"the native expert operation cannot be timed here: {why}")
        return {}
    return {layer: NativeExperts(e) for layer, e in experts.items()}


def _drop_torn_line(path: Path) -> None:
    """Rewrite the file without its incomplete last line (atomically)."""
    from moespec.files import atomic_path

    text = path.read_text()
    with atomic_path(path, force=True) as tmp:
        tmp.write_text(text[: text.rfind("\n") + 1])


def load_raw(path: Path, expect_header: dict | None = None) -> list[dict]:
    """The records of a raw timing file (a torn last line from an interruption is dropped)."""
    lines = Path(path).read_text().splitlines()
    if not lines:
        return []
    try:
        header = json.loads(lines[0])["header"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ValueError(f"{path} is not a moespec benchmark timing file") from None
    if header.get("format") != FORMAT:
        raise ValueError(f"{path} has format {header.get('format')!r}, expected {FORMAT!r}")
    if expect_header is not None and header != json.loads(json.dumps(expect_header)):
        raise SettingError(
            f"{path} was written with other settings; pass a new output or "
            f"{setting('force', True)} to restart"
        )
    records = []
    for number, line in enumerate(lines[1:], start=2):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number != len(lines):
                raise ValueError(f"{path}:{number} is not valid JSON") from None
    return records


def medians(records: Iterable[dict], **where) -> list[dict]:
    """The records matching every `field=value` given."""
    return [r for r in records if all(r.get(k) == v for k, v in where.items())]


def random_experts(
    shape, dtype: torch.dtype, seed: int = 0, *, device="cpu", pack: bool = True
) -> ExpertWeights:
    """One layer of random experts of a named shape's real dimensions (time does not depend
    on the values), on `device`; packed for the CPU's fast path as a loaded model holds them
    (`pack`; a no-op off the CPU)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    e, h, i = shape.num_experts, shape.hidden_size, shape.expert_intermediate_size
    gate_up = torch.randn(e, 2 * i, h, generator=generator, device=device) * 0.02
    down = torch.randn(e, h, i, generator=generator, device=device) * 0.02
    experts = ExpertWeights(gate_up.to(dtype), down.to(dtype))
    return experts.pack() if pack else experts
