"""Measurements remembered between runs, so that `--draft auto` starts on the right choice.

A run measures the target's verify times tau(n), each drafter's draft times h(k) and its
acceptance; without memory every run measures them again from nothing, and on a model whose
step takes a quarter of a millisecond the warm-up and the probes are a visible share of a short
generation. They are kept in one small JSON file (`path()`: the user's cache directory, or
$MOESPEC_MEASUREMENTS), one entry per model, weights, threads and engine, under the machine
that measured them. Read at the start of a generation they seed the running medians and the
acceptance priors, so the first steps plan as the last run ended; written (atomically) at its
end with what this run measured.

What invalidates an entry: another engine (moespec's version and the native sources' digest:
a change of kernel changes the times), another model (its config and weight files' sizes),
weights kind, dtype or thread count (another key). A file that is corrupt, of another layout
version, or written on another machine (CPU model and cores) is ignored with one warning line
and rebuilt. Remembered acceptances are kept at the weight of at most PRIOR_WEIGHT
observations: a new prompt's text moves them within a few steps.
"""

import hashlib
import json
import os
from pathlib import Path

from moespec.files import write_json

LAYOUT = 1  # the file's layout version
PRIOR_WEIGHT = 8.0  # observations a remembered acceptance weighs at most in a new run
ENTRIES = 64  # entries kept at most (the most recently written)
# samples a median must stand on to be remembered: a size measured once or twice in a short
# run, one of those slow, was remembered as several times its cost, and the next runs never
# drafted that far (so never measured it again)
SAMPLES = 3


def path() -> Path | None:
    """The file: $MOESPEC_MEASUREMENTS ("off": none), else measurements.json in the user's
    cache directory ($MOESPEC_CACHE, $XDG_CACHE_HOME/moespec or ~/.cache/moespec)."""
    setting = os.environ.get("MOESPEC_MEASUREMENTS")
    if setting:
        return None if setting.strip().lower() in ("off", "0", "no") else Path(setting)
    from moespec.kernels.native import cache_dir

    return cache_dir() / "measurements.json"


def machine() -> dict:
    from moespec.kernels.isa import this_cpu
    from moespec.provenance import cpu_model

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "family": this_cpu()[2]}


def engine() -> str:
    """moespec's version and the digest of the native pass's sources."""
    import moespec
    from moespec.kernels.native import SOURCES

    digest = hashlib.sha256()
    for source in SOURCES:
        digest.update(source.read_bytes())
    return f"{moespec.__version__}+{digest.hexdigest()[:12]}"


def model_identity(model_dir) -> str:
    """The model's config and the sizes of its weight files, digested."""
    directory = Path(model_dir)
    digest = hashlib.sha256()
    config = directory / "config.json"
    if config.exists():
        digest.update(config.read_bytes())
    for weights in sorted(directory.glob("*.safetensors")):
        digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
    return digest.hexdigest()[:16]


class Remembered:
    """The remembered measurements of one (model, weights, dtype, threads, engine) on this
    machine: `seed(speculation)` before a generation, `take(speculation)` and `save()` after."""

    def __init__(self, file: Path | None, key: str, on_note=None):
        self.file, self.key, self.on_note = file, key, on_note
        self.entries: dict = {}
        self.entry: dict = {}
        self.machine = machine()
        if file is not None:
            self.entries = self._read(file)
            entry = self.entries.get(key)
            self.entry = entry if isinstance(entry, dict) else {}  # a hand-edited one: anew

    @classmethod
    def open(cls, model_dir, *, weights: str | None, dtype: str, threads: int, on_note=None):
        """The entry of this model and settings (empty when none is remembered); reading
        $MOESPEC_MEASUREMENTS or the cache directory's file."""
        key = "|".join(
            [model_identity(model_dir), str(weights or dtype), dtype, f"t{threads}", engine()]
        )
        return cls(path(), key, on_note)

    def _warn(self, line: str) -> None:
        if self.on_note is not None:
            self.on_note(f"warning: {line}")

    def _read(self, file: Path) -> dict:
        if not file.exists():
            return {}
        try:
            data = json.loads(file.read_text())
            if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
                raise ValueError("not a measurements file")
        except (OSError, ValueError) as error:
            self._warn(f"{file}: remembered measurements unreadable ({error}); rebuilding them")
            return {}
        if data.get("layout") != LAYOUT:
            self._warn(
                f"{file}: remembered measurements of layout {data.get('layout')!r}, "
                f"not {LAYOUT}; rebuilding them"
            )
            return {}
        if data.get("machine") != self.machine:
            self._warn(f"{file}: remembered measurements of another machine; rebuilding them")
            return {}
        return data["entries"]

    # -------------------------------------------------------------- into a generation
    def seed_verify_times(self, medians) -> None:
        """Put the remembered tau(n) into running medians (a server's, shared by requests)."""
        if verify := _floats(self.entry.get("verify")):
            medians.seed(verify)

    def seed(self, speculation, verify: bool = True) -> None:
        """Put the remembered tau(n) (unless `verify` is False: shared medians seeded once),
        h(k) and acceptances into fresh speculation state."""
        if not self.entry:
            return
        if verify:
            self.seed_verify_times(speculation.verify_times)
        drafters = self.entry.get("drafters")
        drafters = drafters if isinstance(drafters, dict) else {}
        for name, option in speculation.options.items():
            kept = drafters.get(name)
            if not isinstance(kept, dict):
                continue
            policy = option.policy
            if draft := _floats(kept.get("draft")):
                policy.draft_times.seed(draft)
            prior = kept.get("acceptance")
            if _pair(prior) and policy.fixed is None:
                policy.accepted, policy.rejected = prior
                # evidence already: a model drafter's first look (a catch-up pass and a
                # draft step, some 1 ms on the demo pair) is not bought again
                policy.observations = max(policy.observations, round(sum(prior)))
            levels = kept.get("levels")
            prior_of = getattr(option.drafter, "prior", None)
            if prior_of is not None and isinstance(levels, list):
                prior_of.restore(levels)

    # -------------------------------------------------------------- out of one
    def take(self, speculation) -> None:
        """This generation's measurements into the entry (what it did not measure is kept)."""
        entry = self.entry
        times = speculation.verify_times
        verify = _floats(entry.get("verify")) | {
            n: s for n, s in times.known().items() if times.counted(n) >= SAMPLES
        }
        one = verify.get(1)  # no pass dearer than as many one-token passes (draft_policy)
        entry["verify"] = {str(n): s for n, s in sorted(verify.items()) if not one or s <= n * one}
        if not isinstance(entry.get("drafters"), dict):
            entry["drafters"] = {}
        drafters = entry["drafters"]
        for name, option in speculation.options.items():
            kept = drafters.get(name)
            if not isinstance(kept, dict):
                kept = drafters[name] = {}
            policy = option.policy
            drafts = policy.draft_times
            draft = _floats(kept.get("draft")) | {
                k: s for k, s in drafts.known().items() if drafts.counted(k) >= SAMPLES
            }
            kept["draft"] = {str(k): s for k, s in sorted(draft.items())}
            a, b = policy.accepted, policy.rejected
            scale = min(1.0, PRIOR_WEIGHT / (a + b)) if a + b > 0 else 1.0
            kept["acceptance"] = [a * scale, b * scale]
            if (prior := getattr(option.drafter, "prior", None)) is not None:
                kept["levels"] = prior.remember(PRIOR_WEIGHT)

    def save(self) -> None:
        """Write the file atomically (at most ENTRIES entries, this one newest)."""
        if self.file is None or not self.entry:
            return
        entries = {k: v for k, v in self.entries.items() if k != self.key}
        entries[self.key] = self.entry
        entries = dict(list(entries.items())[-ENTRIES:])
        data = {"layout": LAYOUT, "machine": self.machine, "entries": entries}
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            write_json(self.file, data, force=True)
        except OSError as error:
            self._warn(f"{self.file}: could not remember this run's measurements ({error})")


def _floats(table) -> dict[int, float]:
    """{int key: positive float} of a JSON object, nothing that is not one."""
    if not isinstance(table, dict):
        return {}
    out = {}
    for key, value in table.items():
        try:
            k = int(key)
        except ValueError:
            continue
        if isinstance(value, (int, float)) and value > 0 and k >= 0:
            out[k] = float(value)
    return out


def _pair(value) -> bool:
    return (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(v, (int, float)) and v >= 0 for v in value)
        and sum(value) > 0
    )
