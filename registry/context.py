"""The typed context the store's write, read and maintenance paths take (ingest, service, check,
prune, lost, access, hub): the database engine, the blob store, the worker pool and the settings,
with the two reads every path shares. registry/registry.Registry provides it; mypy checks each use.
Those modules depend on this interface, not on the Registry that calls them."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from mfsreg.registry.blobs.base import BlobStore
    from mfsreg.registry.blobs.packs import StoredChunk
    from mfsreg.registry.config import Settings


class Kept:
    """The ``size`` values put last, by key, kept in memory, safe across threads (what a server
    reads again and again and a key fixes: a version document's parts by its tag)."""

    def __init__(self, size: int):
        self.size = size
        self._items: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> Any | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: str, value: Any) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)


class Store(Protocol):
    engine: Engine
    pool: ThreadPoolExecutor
    settings: Settings
    documents: Kept  # version documents' manifest and chunk table, by tag (service.version_doc)

    @property
    def blobs(self) -> BlobStore:
        """The blob store, opened on first use."""
        ...

    def locate(self, ids: Iterable[str]) -> dict[str, StoredChunk]:
        """Where chunks and the bases of their deltas are stored."""
        ...

    def read_payloads(self, chunks: list[StoredChunk]) -> Iterator[tuple[StoredChunk, bytes]]:
        """The stored payloads of chunks, read from their packs (bytes-like: memoryviews of the reads)."""
        ...
