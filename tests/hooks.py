"""Progress objects that run something at a chosen moment of a push: the public hook a test uses to
put another client's work (a prune, say) between a push's negotiation and its upload."""

from __future__ import annotations

from collections.abc import Callable

from registry.progress import NullProgress


class OnSend(NullProgress):
    """Calls ``action`` when the push starts sending its missing chunks (after it has asked which
    chunks are stored, before its commit), the first time only; ``results`` holds what it returned."""

    def __init__(self, action: Callable[[], object]):
        self.action = action
        self.results: list = []

    def start(self, task: str, total: int) -> None:
        if task == "send" and not self.results:
            self.results.append(self.action())


class OnFirstPut:
    """A registry's blob store that runs ``action`` just before its first put of a blob, once a
    writer has announced that pack: a prune that runs there takes the pack for abandoned (with
    --min-age 0) or deletes the bases of its deltas. Everything else goes to the real store."""

    def __init__(self, store, action: Callable[[], object]):
        self._store = store
        self.action = action
        self.puts = 0

    def put(self, key: str, data) -> None:
        self.puts += 1
        if self.puts == 1:
            self.action()
        self._store.put(key, data)

    def __getattr__(self, name: str):
        return getattr(self._store, name)


class Tally(NullProgress):
    """Adds up what a push reports: ``total[task]`` as started, ``done[task]`` as advanced."""

    def __init__(self):
        self.total: dict[str, int] = {}
        self.done: dict[str, int] = {}

    def start(self, task: str, total: int) -> None:
        self.total[task] = total
        self.done.setdefault(task, 0)

    def advance(self, task: str, n: int) -> None:
        self.done[task] = self.done.get(task, 0) + n
