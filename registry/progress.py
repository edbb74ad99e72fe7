"""Progress reporting for long transfers, kept free of any UI library.

The core calls ``start(task, total)`` and ``advance(task, n)`` with byte counts; the CLI renders them
with rich progress bars, tests and the API pass nothing. Tasks: "hash", "send", "skip", "fetch", "write".
"""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    def start(self, task: str, total: int) -> None: ...

    def advance(self, task: str, n: int) -> None: ...


class NullProgress:
    def start(self, task: str, total: int) -> None:
        pass

    def advance(self, task: str, n: int) -> None:
        pass
