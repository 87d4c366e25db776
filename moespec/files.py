"""Writing outputs without losing anything: atomic replace, and no clobbering without --force."""

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


class OutputExistsError(FileExistsError):
    """An output file already exists and the caller did not ask to overwrite it."""


def check_writable(path: str | os.PathLike, *, force: bool) -> Path:
    """Refuse early (before any long work) when `path` exists and force is off."""
    path = Path(path)
    if path.exists() and not force:
        raise OutputExistsError(f"{path} already exists (pass --force to overwrite it)")
    if not path.parent.exists():
        raise FileNotFoundError(f"directory {path.parent} does not exist (for output {path})")
    return path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, force: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success rename it into place, else remove it.

    A reader never sees a half-written file, and an interrupted run leaves the old file intact.
    """
    path = check_writable(path, force=force)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; outputs get the usual mode
    try:
        yield tmp
        if path.exists() and not force:  # appeared while we worked
            raise OutputExistsError(f"{path} already exists (pass --force to overwrite it)")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json(path: str | os.PathLike, obj, *, force: bool = False) -> Path:
    """Write `obj` as indented JSON atomically."""
    with atomic_path(path, force=force) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    return Path(path)
