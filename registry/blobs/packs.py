"""Packs: many encoded chunks in one blob, read back by byte range.

One object per chunk would mean millions of tiny objects and requests; one pack of tens of MiB holds
hundreds of chunks, written once and read by ranges. Readers coalesce nearby ranges of one pack
into a single request. A pack is named by a random id, never by its content: prune deletes the blob
of a pack it retired, and a pack named by its bytes would come back under the same name when the
same version is pushed again, racing that deletion.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from mfsreg.registry.blobs.base import BlobStore

COALESCE_GAP = 1 << 20  # read through gaps this small rather than issue another request


class ChunkForm(Protocol):
    """What decoding a chunk needs to know of it, wherever it lies: its id, raw size, encoding,
    encoded size and basis. StoredChunk (a pack's row, in the registry) and wire.Located (a chunk as
    a node learns it from the server's documents and streams) both fit it."""

    @property
    def id(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def encoding(self) -> str: ...
    @property
    def stored_size(self) -> int: ...
    @property
    def basis_id(self) -> str | None: ...


@dataclass(frozen=True)
class StoredChunk:
    """Where and how one chunk is stored."""

    id: str
    size: int  # raw bytes
    encoding: str
    stored_size: int  # encoded bytes in the pack
    pack_id: str
    offset: int
    basis_id: str | None = None
    depth: int = 0  # deltas between this chunk and a plain one


def pack_key(pack_id: str) -> str:
    return f"packs/{pack_id[:2]}/{pack_id}.pack"


class PackWriter:
    """Collects encoded chunks and writes a pack whenever ``pack_size`` bytes are buffered.

    ``on_flush(pack_id, pack_bytes, chunks)`` runs after the pack is durable, so that the caller can
    record the chunks as stored: a chunk is never recorded before its bytes are safe. ``on_put``
    runs before the blob is written, so that a registry can note a blob it may have to clean up.
    """

    def __init__(
        self,
        store: BlobStore,
        pack_size: int,
        on_flush: Callable[[str, int, list[StoredChunk]], None],
        on_put: Callable[[str, int], None] | None = None,
        on_failed_put: Callable[[str], None] | None = None,
    ):
        self.store = store
        self.pack_size = pack_size
        self.on_flush = on_flush
        self.on_put = on_put  # (pack_id, pack_bytes) before the blob is written
        self.on_failed_put = on_failed_put  # (pack_id) when writing the blob raised
        # One buffer, grown to the largest pack and reused for every pack: joining a fresh pack of
        # tens of MiB per flush cost a page fault per 4 KiB (most of the writer's time in an
        # embedded push). It grows only as far as payloads reach: the server makes one writer per
        # uploaded batch, far smaller than pack_size.
        self._buf = bytearray(0)
        self._size = 0
        self._pending: list[tuple] = []
        self.bytes_written = 0

    def add(
        self, chunk_id: str, size: int, encoding: str, payload: bytes, basis_id: str | None = None, depth: int = 0
    ) -> None:
        self._pending.append((chunk_id, size, encoding, self._size, len(payload), basis_id, depth))
        end = self._size + len(payload)
        # in place where the buffer is long enough; past its end the slice grows it (amortised)
        self._buf[self._size : end] = payload
        self._size = end
        if self._size >= self.pack_size:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        pack_id = uuid.uuid4().hex
        if self.on_put is not None:
            self.on_put(pack_id, self._size)
        try:
            with memoryview(self._buf)[: self._size] as data:  # released before the buffer may grow again
                self.store.put(pack_key(pack_id), data)
        except Exception:
            if self.on_failed_put is not None:
                self.on_failed_put(pack_id)
            raise
        chunks = [
            StoredChunk(cid, size, enc, n, pack_id, off, basis, depth)
            for cid, size, enc, off, n, basis, depth in self._pending
        ]
        total = self._size
        self.bytes_written += total
        self._size, self._pending = 0, []
        self.on_flush(pack_id, total, chunks)


def read_payloads(store: BlobStore, chunks: Iterable[StoredChunk]) -> Iterator[tuple[StoredChunk, memoryview]]:
    """Encoded payloads of ``chunks``, pack by pack, with nearby ranges merged into one read."""
    by_pack: dict[str, list[StoredChunk]] = defaultdict(list)
    for c in chunks:
        by_pack[c.pack_id].append(c)
    for pack_id, items in by_pack.items():
        items.sort(key=lambda c: c.offset)
        groups: list[list[StoredChunk]] = []
        for c in items:
            if groups and c.offset - (groups[-1][-1].offset + groups[-1][-1].stored_size) <= COALESCE_GAP:
                groups[-1].append(c)
            else:
                groups.append([c])
        ranges = [(g[0].offset, g[-1].offset + g[-1].stored_size) for g in groups]
        for g, (start, _end), data in zip(groups, ranges, store.get_ranges(pack_key(pack_id), ranges)):
            view = memoryview(data)
            for c in g:
                yield c, view[c.offset - start : c.offset - start + c.stored_size]
