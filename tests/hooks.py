"""Progress objects that run something at a chosen moment of a push: the public hook a test uses to
put another client's work (a prune, say) between a push's negotiation and its upload."""

from __future__ import annotations

from collections.abc import Callable

from mfsreg.registry.progress import NullProgress


class OnSend(NullProgress):
    """Calls ``action`` when the push starts sending its missing chunks (after it has asked which
    chunks are stored, before its commit), the first time only; ``results`` holds what it returned."""

    def __init__(self, action: Callable[[], object]):
        self.action = action
        self.results: list = []

    def start(self, task: str, total: int) -> None:
        if task == "send" and not self.results:
            self.results.append(self.action())


class OnFirst:
    """A registry's blob store that runs ``action`` just before the first call of its ``method``
    ("put": once a writer has announced that pack, so a prune there takes the pack for abandoned
    with --min-age 0, or deletes the bases of its deltas; "get_ranges": before a push reads the
    bases it chose). ``calls`` counts that method's calls. Everything else goes to the real store."""

    def __init__(self, store, method: str, action: Callable[[], object]):
        self._store = store
        self._method = method
        self.action = action
        self.calls = 0

    def __getattr__(self, name: str):
        real = getattr(self._store, name)
        if name != self._method:
            return real

        def hooked(*args, **kwargs):
            self.calls += 1
            if self.calls == 1:
                self.action()
            return real(*args, **kwargs)

        return hooked


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
