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
