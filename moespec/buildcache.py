"""Where moespec keeps what it builds at first use (the C libraries, remembered measurements),
and the C compiler it builds with: no torch, so the offload policies can use it too."""

import os
import shutil
from pathlib import Path


def cache_dir() -> Path:
    """$MOESPEC_CACHE, else $XDG_CACHE_HOME/moespec, else ~/.cache/moespec."""
    if root := os.environ.get("MOESPEC_CACHE"):
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "moespec"


def find_compiler() -> str | None:
    """The first of $CC, cc, gcc and clang on the PATH (None: no compiler)."""
    for name in filter(None, (os.environ.get("CC"), "cc", "gcc", "clang")):
        if path := shutil.which(name):
            return path
    return None
