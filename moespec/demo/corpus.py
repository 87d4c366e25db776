"""The embedded corpus: the running interpreter's standard-library sources, split by file.

Real text every machine with Python has, with no download. The demo models are trained on the
training files (scripts/train_demo.py); the held-out files — one in HELD_OUT_MODULUS, chosen by
a hash of the relative path, so the split is the same on every machine — are what moespec
measures on (routing traces for `plan`, whole-model verify times, the demo's checks).
"""

import hashlib
import sysconfig
from pathlib import Path

#: Directory names skipped anywhere below the stdlib root: installed third-party packages,
#: byte-code caches, and the test suites (``test/``, ``ctypes/test``, ``distutils/tests``,
#: ``lib2to3/tests``, ``idlelib/idle_test``, ``tkinter/test``, ``unittest/test`` ...). Test
#: suites are excluded because they are mostly fixtures and would swamp the library code.
EXCLUDED_DIR_NAMES = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)
#: Top-level entries skipped because their content depends on how this interpreter was built
#: (compiler flags, install prefix), not on the Python version: ``config-3.X-<platform>/`` and
#: ``_sysconfigdata_*.py``. Leaving them out keeps the corpus fingerprint equal across builds.
EXCLUDED_BUILD_PREFIXES = ("config-", "_sysconfigdata_")
#: One file in HELD_OUT_MODULUS is held out, chosen by a hash of its relative path.
HELD_OUT_MODULUS = 20


def stdlib_root() -> Path:
    """The running interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_excluded(rel: Path) -> bool:
    """Whether a stdlib-relative ``.py`` path is left out of the corpus (see the constants)."""
    if any(part in EXCLUDED_DIR_NAMES for part in rel.parts[:-1]):
        return True
    return rel.parts[0].startswith(EXCLUDED_BUILD_PREFIXES)


def is_held_out(rel_path: str) -> bool:
    """Deterministic ~5% split by a hash of the path, so it is stable across machines."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % HELD_OUT_MODULUS == 0


def list_corpus_files(root: Path) -> list[str]:
    """Sorted stdlib-relative POSIX paths of the corpus files below ``root``."""
    rels = (p.relative_to(root) for p in root.rglob("*.py") if p.is_file())
    return sorted(rel.as_posix() for rel in rels if not is_excluded(rel))


def held_out_documents(limit: int | None = None, max_chars: int | None = None):
    """The held-out files as `moespec.routing.corpus.Document`s (name "stdlib/<path>"), in
    sorted order: at most `limit` files, each cut to `max_chars` characters."""
    from moespec.routing.corpus import Document

    root = stdlib_root()
    paths = [rel for rel in list_corpus_files(root) if is_held_out(rel)]
    if not paths:
        raise ValueError(f"no held-out Python sources found under {root}")
    for rel in paths[:limit]:
        text = (root / rel).read_text(encoding="utf-8", errors="replace")
        yield Document(f"stdlib/{rel}", text[:max_chars] if max_chars else text)
