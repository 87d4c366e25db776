"""Writing outputs without losing anything: atomic replace, and no clobbering without force."""

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from moespec.errors import NamesSettings, SettingError, setting


class OutputExistsError(NamesSettings, FileExistsError):
    """An output file already exists and the caller did not ask to overwrite it."""

    def __init__(self, path):
        super().__init__(f"{path} already exists (pass {setting('force', True)} to overwrite it)")


def check_writable(path: str | os.PathLike, *, force: bool) -> Path:
    """Refuse early (before any long work) when `path` exists and force is off."""
    path = Path(path)
    if path.exists() and not force:
        raise OutputExistsError(path)
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
            raise OutputExistsError(path)
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


@contextlib.contextmanager
def output_directory(path: str | os.PathLike) -> Iterator[Path]:
    """Make the directory of a run's outputs (with its parents); if the run fails or is
    interrupted before anything is written into it, remove it again: a run leaves what it
    finished or nothing, never an empty directory."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path} exists and is not a directory")
    created = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    try:
        yield path
    except BaseException:
        if created and not any(path.iterdir()):
            path.rmdir()
        raise


@contextlib.contextmanager
def publish_files(directory: str | os.PathLike, names: list[str], *, force: bool) -> Iterator[Path]:
    """Write a set of files together: yield a fresh folder beside `directory` to write
    `names` into; on success move them into `directory` (the folder itself becomes it when
    it does not exist yet), else remove the folder. An interruption leaves none of the set."""
    import shutil

    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"{directory} exists and is not a directory")
    if directory.is_dir():
        for name in names:
            check_writable(directory / name, force=force)
    parent = directory.absolute().parent
    if not parent.is_dir():
        raise FileNotFoundError(f"directory {parent} does not exist (for output {directory})")
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=parent))
    os.chmod(staging, 0o777 & ~_umask())  # mkdtemp makes 0700; outputs get the usual mode
    try:
        yield staging
        if not directory.exists():
            os.replace(staging, directory)  # the whole set appears at once
            return
        for name in names:
            if (directory / name).exists() and not force:  # appeared while we worked
                raise OutputExistsError(directory / name)
            os.replace(staging / name, directory / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


class Journal:
    """A long run's finished work, one JSON object a line, each appended (and flushed) as it
    finishes, so an interrupted run resumes where it stopped. The first line is a header; a
    rerun with another header is refused (or, with `restart`, starts the file afresh); a torn
    last line from an interruption is dropped. `entries` holds what earlier runs finished."""

    def __init__(self, path: str | os.PathLike, header: dict, *, restart: bool = False):
        self.path = Path(path)
        header = json.loads(json.dumps(header))  # as it reads back
        self.entries: list[dict] = []
        if self.path.exists() and not restart:
            lines = self.path.read_text().splitlines()
            try:
                found = json.loads(lines[0])["header"]
            except (IndexError, json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{self.path} is not a moespec journal") from None
            if found != header:
                raise SettingError(
                    f"{self.path} holds a run with other settings; pass {setting('force', True)}"
                    " to start afresh"
                )
            for line in lines[1:]:
                try:
                    self.entries.append(json.loads(line))
                except json.JSONDecodeError:  # torn by an interruption: the last line
                    break
        with atomic_path(self.path, force=True) as tmp:
            tmp.write_text(
                "".join(json.dumps(e) + "\n" for e in [{"header": header}, *self.entries])
            )

    def append(self, entry: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(entry) + "\n")

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
