"""Rich progress bars for the core's byte counters (registry/progress.py); silent off a terminal."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING

from mfsreg.registry.progress import NullProgress

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

LABELS = {
    "hash": "hashed",
    "skip": "skipped (stored)",
    "send": "sent",
    "fetch": "fetched",
    "write": "written",
    "verify": "checked",
    "repack": "repacked",
    "server": "on the server",
}


class RichProgress:
    def __init__(self, progress: Progress):
        self._p = progress
        self._tasks: dict[str, TaskID] = {}

    def start(self, task: str, total: int | None) -> None:
        if task in self._tasks:
            self._p.update(self._tasks[task], total=total)
        else:
            self._tasks[task] = self._p.add_task(LABELS.get(task, task), total=total)

    def advance(self, task: str, n: int) -> None:
        if task in self._tasks:
            self._p.advance(self._tasks[task], n)


@contextmanager
def progress_for(quiet: bool):
    """Bars on an interactive stderr unless ``quiet`` (--json); otherwise a no-op reporter."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    console = Console(stderr=True)
    if quiet or not console.is_terminal:
        yield NullProgress()
        return
    with Progress(
        TextColumn("{task.description:>16}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    ) as p:
        yield RichProgress(p)


def is_tty() -> bool:
    return sys.stdout.isatty()
