"""SpAc's per-layer decisions in C: `spac_native.c`, built on first use, and its fallback.

A decode step of Qwen3-30B-A3B runs SpAc 48 times (one per MoE layer): the plan (the balancer's
record, the queue's cancellation, the split of the needed experts, the pool's LRU order) and
the finish (the estimator's update, the pool's re-keying, the balancer's tau, the prefetch
queue). In Python and numpy that was ~77 us per layer on the host of
`benchmarks/results/policy_overhead.json`, ~3.7 ms a step: some 40 numpy calls on 128-expert
rows and a Python loop per needed expert. The C extension does one layer's plan (with the
driver's pins and hit count) in one call and its finish (unpin, end_layer, the unit times) in
another, over the same arrays the Python classes own: `estimator.utility`, the balancer's
shares, `tau`, the cache's `present`, `pinned`, `ready_at`, `UnitTimes`' sums. The eviction pool
and the prefetch queue live in C alone (`victim`, `next_prefetch`, `admitted` reach them).

The C follows the Python classes (estimator.py, balancer.py, queues.py, spac.py) step by step
and in their floating-point order, built without fused multiply-adds, so the two decide alike;
tests/test_offload_spac_kernel.py runs both on random traces and compares every decision.

Built with the system's C compiler (`$CC`, else cc, gcc or clang) against Python's and numpy's
headers into the user's cache (`$MOESPEC_CACHE`, else `$XDG_CACHE_HOME/moespec` or
`~/.cache/moespec`), keyed by the source, the compiler, Python and numpy, as
`moespec.kernels.native` builds its loops. Where there is no compiler, no headers, the build
fails, or `MOESPEC_NATIVE=0`, SpAc runs its Python classes (`why_unavailable` says why).
"""

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np

from moespec.buildcache import cache_dir, find_compiler

SOURCE = Path(__file__).with_name("spac_native.c")
FLAGS = ["-O2", "-shared", "-fPIC", "-ffp-contract=off", "-std=gnu11"]
VERSION = 2  # spac_native.VERSION of the source this module speaks to
REFERENCE_CODES = {"count": 0, "level": 1, "previous": 2}


def _build(compiler: str, out_dir: Path) -> Path:
    """Compile spac_native.c once per source, compiler, Python and numpy; the library's path."""
    includes = [sysconfig.get_paths()["include"], np.get_include()]
    version = subprocess.run(
        [compiler, "-dumpversion"], capture_output=True, text=True, timeout=30
    ).stdout
    identity = [
        SOURCE.read_bytes(),
        compiler,
        version,
        sys.version,
        np.__version__,
        *FLAGS,
        *includes,
    ]
    key = hashlib.sha256(repr(identity).encode()).hexdigest()[:16]
    target = out_dir / f"spac_native_{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
    os.close(fd)
    command = [compiler, *FLAGS, *(f"-I{d}" for d in includes), str(SOURCE), "-o", tmp, "-lm"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        os.unlink(tmp)
        last = (done.stderr.strip().splitlines() or ["failed"])[-1]
        raise RuntimeError(f"{compiler} could not build {SOURCE.name}: {last}")
    os.replace(tmp, target)  # atomic: a concurrent build leaves one whole file
    return target


@functools.cache
def _load() -> tuple[object | None, str | None]:
    """(the extension module, None) or (None, why not)."""
    if os.environ.get("MOESPEC_NATIVE", "1").strip().lower() in ("0", "off", "no", "false"):
        return None, "turned off by MOESPEC_NATIVE"
    compiler = find_compiler()
    if compiler is None:
        return None, "no C compiler found ($CC, cc, gcc or clang)"
    try:
        path = _build(compiler, cache_dir() / "spac")
        loader = importlib.machinery.ExtensionFileLoader("spac_native", str(path))
        spec = importlib.util.spec_from_file_location("spac_native", path, loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except (OSError, RuntimeError, ImportError, subprocess.SubprocessError) as e:
        return None, f"the SpAc kernel did not build or load: {e}"
    if module.VERSION != VERSION:
        return None, f"{path.name} is version {module.VERSION}, not {VERSION}"
    return module, None


def available() -> bool:
    return _load()[0] is not None


def why_unavailable() -> str | None:
    return _load()[1]


def make_state(policy, cache):
    """The C state of `policy` (a SpAcPolicy being reset on `cache`): its config, and the
    arrays its Python parts own, which the C reads and writes in place."""
    module = _load()[0]
    cfg, est, bal, times = policy.config, policy.estimator, policy.balancer, policy.unit_times
    fixed_up, fixed_down = est._fixed if est._fixed is not None else (0.0, 0.0)
    config = (
        REFERENCE_CODES[est.reference],
        int(est.adaptive),
        int(cfg.balancer),
        int(cfg.prefetch),
        int(cfg.evict),
        float(fixed_up),
        float(fixed_down),
        float(est.forgetting),
        est.window_tokens / est.max_utility,  # the "level" reading's tokens per level
        int(cfg.static_tau),
        int(cfg.warmup_steps),
        int(policy.draft_length),
        int(policy.top_k),
        int(cache.budget_bytes),
        float(policy.tier_overlap),
    )
    arrays = (
        cache.present,
        cache.pinned,
        cache.ready_at,
        cache.expert_bytes,
        est.utility,
        est.previous,
        est.theta_up,
        est.theta_down,
        bal.slot_share,
        bal.expert_share,
        bal.distinct,
        bal.passes,
        policy.tau,
    )
    unit_times = (
        times.totals,
        times.rest,
        times.rest_passes,
        times.layer_seconds,
        times.layer_passes,
    )
    shape = (cache.num_layers, cache.num_experts, est.max_utility)
    return module.State(shape, config, arrays, unit_times)
