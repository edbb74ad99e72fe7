"""Bounded work on big inputs: a parallel map with a window of jobs in flight, and batches cut by size.

pool.map submits its whole input at once, which would hold every chunk of a multi-GB file in
memory; windowed_map keeps at most ``window`` jobs in flight and yields results in order."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, wait
from typing import TypeVar

DEFAULT_WINDOW = 64
_T = TypeVar("_T")


def windowed_map(pool: Executor, fn: Callable, items: Iterable, window: int = DEFAULT_WINDOW) -> Iterator:
    pending: deque = deque()
    try:
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        # Stopped early (an error, or the consumer gave up): jobs not started are dropped and
        # running ones are awaited, so that no job still reads a buffer (an mmap) that the
        # caller closes next.
        for f in pending:
            f.cancel()
        wait(pending)


def sized_batches(items: Iterable[_T], size: Callable[[_T], int], limit: int) -> Iterator[list[_T]]:
    """``items`` in order, cut into lists that each reach ``limit`` by ``size`` (the last may hold less)."""
    batch: list[_T] = []
    n = 0
    for item in items:
        batch.append(item)
        n += size(item)
        if n >= limit:
            yield batch
            batch, n = [], 0
    if batch:
        yield batch
