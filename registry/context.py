"""The typed context the store's write, read and maintenance paths take (ingest, service, check,
prune, lost, access, hub): the database engine, the blob store, the worker pool and the settings,
with the two reads every path shares. registry/registry.Registry provides it; mypy checks each use.
Those modules depend on this interface, not on the Registry that calls them."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from mfsreg.registry.blobs.base import BlobStore
    from mfsreg.registry.blobs.packs import StoredChunk
    from mfsreg.registry.config import Settings


class Store(Protocol):
    engine: Engine
    pool: ThreadPoolExecutor
    settings: Settings

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
