"""Progress on a terminal: what is being done, a bar, and an estimate of the time left.

Every command that can run for more than a few seconds shows one line on stderr while it
works (rich; transient, so it is gone when the work is). It is quiet under --json, when stderr
is not a terminal (piped, redirected, a log, CI) or with TERM=dumb: output meant for a file or
a program never carries a bar's redraws. Library functions take a `Progress` (or a bool, see
`using`) and report into it; they never decide whether it shows. The line is redrawn when the
work reports, never by a thread of its own, so a bar does not compete with timed runs.

    with Progress(show_progress(quiet=args.json)) as progress:
        progress.start("recording routing", total=tokens, unit="tokens")
        progress.advance(512)
        progress.start("simulating", total=12)
        progress.step("lru @ cache ratio 0.25")  # the step before it is done
"""

import contextlib
import os
import sys
from collections.abc import Iterator


def show_progress(quiet: bool = False, stream=None) -> bool:
    """Whether a progress bar should show: not quiet, and `stream` (stderr) a terminal
    that can redraw a line."""
    stream = sys.stderr if stream is None else stream
    if quiet or os.environ.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class Progress:
    """One line at a time on stderr: a stage's description, bar, count, elapsed and left.
    Disabled, every method does nothing, so callers never test whether it shows."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._bar = None
        self._task = None
        self._description = ""
        self._stepped = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def start(self, description: str, total: int | None = None, unit: str = "") -> None:
        """A new stage (it replaces the line of the one before): `total` units of work, or
        None when the amount is unknown (a spinner and the elapsed time)."""
        self._description, self._stepped = description, False
        if not self.enabled:
            return
        bar = self._open()
        if self._task is not None:
            bar.remove_task(self._task)
        self._task = bar.add_task(description, total=total, unit=unit)
        bar.refresh()

    def advance(self, count: float = 1) -> None:
        if self._task is not None:
            self._bar.advance(self._task, count)
            self._bar.refresh()

    def step(self, label: str) -> None:
        """Counted steps: the previous step is done, `label` is the one now running."""
        if self._task is None:
            return
        if self._stepped:
            self._bar.advance(self._task, 1)
        self._stepped = True
        self._bar.update(self._task, description=f"{self._description}: {label}")
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = self._task = None

    def _open(self):
        if self._bar is None:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[unit]}"),
                TimeElapsedColumn(),
                TextColumn("elapsed,"),
                TimeRemainingColumn(),
                TextColumn("left"),
                console=Console(stderr=True),
                transient=True,
                auto_refresh=False,
            )
            self._bar.start()
        return self._bar


@contextlib.contextmanager
def using(progress: "Progress | bool | None") -> Iterator[Progress]:
    """The Progress a library function reports into: the caller's own (left open for its
    next stage), or for True a new one that shows when stderr is a terminal, for
    False/None a silent one."""
    if isinstance(progress, Progress):
        yield progress
        return
    with Progress(bool(progress) and show_progress()) as own:
        yield own
