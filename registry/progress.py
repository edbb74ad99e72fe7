"""Progress reporting for long transfers, kept free of any UI library.

The core calls ``start(task, total)`` and ``advance(task, n)`` with byte counts (a total of None: of
unknown size, such as the wait for a server's check or prune); the CLI renders them with rich
progress bars, tests and the API pass nothing. Tasks: "hash", "send", "skip", "fetch", "write",
"server".
"""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    def start(self, task: str, total: int | None) -> None: ...

    def advance(self, task: str, n: int) -> None: ...


class NullProgress:
    def start(self, task: str, total: int | None) -> None:
        pass

    def advance(self, task: str, n: int) -> None:
        pass
