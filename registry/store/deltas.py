"""Choosing a basis for each new chunk, and reading basis bytes back.

The basis is the chunk at the same (tensor, chunk index) in the parent, else in the member sharing
most chunks, else in the first version. One MAX_DEPTH deep, or unreadable down its chain, gives way
to its own basis; with none left, the chunk is stored plain.
See docs/design/deltas.md.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Sequence

from mfsreg.registry.blobs.packs import StoredChunk
from mfsreg.registry.errors import IntegrityError, NotFound
from mfsreg.registry.format.chunking import ChunkRef
from mfsreg.registry.format.safetensors import TensorSpan
from mfsreg.registry.store.lost import through_lost, warn_damaged_basis, warn_lost_bases

MAX_DEPTH = 3  # a pull decodes at most this many deltas on top of a plain chunk
Position = tuple[str, int]


def positions(chunks: Sequence[ChunkRef], tensors: Sequence[TensorSpan]) -> dict[int, Position]:
    """chunk offset -> (tensor name, index of the chunk within that tensor)."""
    out: dict[int, Position] = {}
    ts = sorted(tensors, key=lambda t: t.start)
    i = 0
    for t in ts:
        k = 0
        while i < len(chunks) and chunks[i].offset < t.start:
            i += 1
        while i < len(chunks) and chunks[i].offset < t.end:
            out[chunks[i].offset] = (t.name, k)
            k += 1
            i += 1
    return out


def position_index(files: Iterable[tuple[Sequence[ChunkRef], Sequence[TensorSpan]]]) -> dict[Position, ChunkRef]:
    """(tensor name, index) -> chunk, over every file of a version."""
    out: dict[Position, ChunkRef] = {}
    for chunks, tensors in files:
        by_offset = {c.offset: c for c in chunks}
        for off, pos in positions(chunks, tensors).items():
            out[pos] = by_offset[off]
    return out


def plan_bases(
    new_files: Iterable[tuple[Sequence[ChunkRef], Sequence[TensorSpan]]],
    basis_index: dict[Position, ChunkRef],
    wanted: set[str],
) -> dict[str, str]:
    """new chunk id -> basis chunk id, for the chunks in ``wanted`` that have a counterpart."""
    out: dict[str, str] = {}
    for chunks, tensors in new_files:
        by_offset = {c.offset: c for c in chunks}
        for off, pos in positions(chunks, tensors).items():
            c = by_offset[off]
            b = basis_index.get(pos)
            if c.id in wanted and c.id not in out and b is not None and b.id != c.id and b.itemsize == c.itemsize:
                out[c.id] = b.id
    return out


def cap_depth(
    basis_id: str,
    located: dict[str, StoredChunk],
    lost: Container[str] = frozenset(),
    damaged: Container[str] = frozenset(),
) -> str | None:
    """The basis to use instead of ``basis_id`` so that the new delta stays within MAX_DEPTH and
    can be encoded: a basis whose bytes, or those of a basis down its chain, lie in a pack the blob
    store lost (``lost``, registry/store/lost.py) or are chunks this push has read and found ``damaged``
    (push --mend-damaged: check.unreadable_or_damaged) cannot be read, so the next one down the
    chain is taken (a chunk below the bad one still decodes). None: store the chunk plain."""
    b = located.get(basis_id)
    unreadable = lost or damaged
    while b is not None and (b.depth >= MAX_DEPTH or (unreadable and through_lost(b.id, located, lost, damaged))):
        b = located.get(b.basis_id) if b.basis_id else None
    return b.id if b is not None else None


class BasisReader:
    """Raw bytes of stored chunks, decoding delta chains, with a small byte-bounded LRU cache.

    ``fetch(chunks)`` yields (chunk, payload); ``decode(chunk, payload, basis)`` returns verified raw
    bytes; ``locate(ids)`` says where chunks are recorded now. Thread-safe: encoder threads call
    ``raw`` concurrently.
    """

    def __init__(
        self,
        located: dict[str, StoredChunk],
        fetch: Callable,
        decode: Callable,
        locate: Callable[[list[str]], dict[str, StoredChunk]],
        cache_bytes: int = 256 << 20,
    ):
        self.located = located
        self._fetch = fetch
        self._decode = decode
        self._locate = locate  # where chunks are recorded now (Registry.locate): tells a prune from a lost blob
        self._cache: OrderedDict[str, bytes] = OrderedDict()
        self._cached = 0
        self._limit = cache_bytes
        self._lock = threading.Lock()
        self._payloads: dict[str, bytes] = {}
        self._skipped_packs: set[str] = set()  # packs a prune emptied, or storage lost, since ``located`` was read
        self._damaged: set[str] = set()  # chunks whose stored bytes do not decode to their id (bit rot)

    def _chain(self, chunk_id: str | None) -> list[str]:
        """``chunk_id`` and the bases its delta decodes against, as far as ``located`` knows them."""
        chain: list[str] = []
        while chunk_id and chunk_id in self.located and chunk_id not in chain:
            chain.append(chunk_id)
            chunk_id = self.located[chunk_id].basis_id
        return chain

    def prefetch(self, ids: Iterable[str | None]) -> None:
        """Read the payloads of ``ids`` and of the bases they need in one call, so the store can
        coalesce them into a few range reads (one request per basis chunk is slow on S3). A None
        (no basis) is passed over."""
        want: set[str] = set()
        for i in ids:
            for c in self._chain(i):
                if c in self._cache:
                    break  # decoded already: its bases are not needed
                want.add(c)
        want -= set(self._payloads)
        if want:
            try:
                for c, payload in self._fetch([self.located[i] for i in want]):
                    self._payloads[c.id] = bytes(payload)
            except NotFound:
                pass  # a pack deleted by a prune meanwhile: ``usable`` reads the rest one by one

    def usable(self, chunk_id: str) -> bytes | None:
        """The raw bytes of basis ``chunk_id``, or None where they cannot be read (a prune deleted its
        pack, the blob store lost it or cut it short, or a chunk down its chain is damaged): the new
        chunk is then stored plain. Warns once per lost pack, and once a push for damage; a pack or
        chain found so is set aside, not read or looked up again.
        See docs/design/deltas.md."""
        chain = self._chain(chunk_id)
        if any(self.located[i].pack_id in self._skipped_packs or i in self._damaged for i in chain):
            return None
        try:
            return self.raw(chunk_id)
        except IntegrityError as exc:
            # A chunk of the chain is damaged where it is stored (its pack is there, its bytes are
            # not). The push goes on and its new chunk goes plain; the damage is the stored
            # versions' to mend (check --read-data, push --mend-damaged).
            # Set aside: the damaged chunk and those leaning on it, not the bases below it, which read.
            bad = exc.chunk_id if exc.chunk_id is not None else chunk_id
            gone = set(chain[: chain.index(bad) + 1]) if bad in chain else set(chain)
            with self._lock:
                fresh = not self._damaged  # said once a push: the first damaged chunk stands for the rest
                self._damaged |= gone
            if fresh:
                warn_damaged_basis(bad, str(exc))
            return None
        except NotFound as exc:
            now = self._locate(chain)
            moved = {
                self.located[i].pack_id for i in chain if i not in now or now[i].pack_id != self.located[i].pack_id
            }
            lost = exc.pack_id if not moved else None
            with self._lock:
                fresh = lost is not None and lost not in self._skipped_packs
                self._skipped_packs |= moved | ({lost} if lost else set())
            if fresh and lost is not None:
                warn_lost_bases({lost: str(exc)})
            return None

    def raw(self, chunk_id: str) -> bytes:
        with self._lock:
            hit = self._cache.get(chunk_id)
            if hit is not None:
                self._cache.move_to_end(chunk_id)
                return hit
        c = self.located[chunk_id]
        basis = self.raw(c.basis_id) if c.basis_id else None
        with self._lock:
            payload = self._payloads.pop(chunk_id, None)
        if payload is None:
            try:
                ((_, payload),) = list(self._fetch([c]))
            except NotFound as exc:
                exc.pack_id = c.pack_id  # which pack of the chain failed: ``usable`` sets only that one aside
                raise
        try:
            data = self._decode(c, payload, basis)
        except IntegrityError as exc:
            exc.chunk_id = (
                chunk_id  # which chunk of the chain is damaged: ``usable`` sets aside only it and those above
            )
            raise
        with self._lock:
            if chunk_id not in self._cache:
                self._cache[chunk_id] = data
                self._cached += len(data)
                while self._cached > self._limit and len(self._cache) > 1:
                    _, old = self._cache.popitem(last=False)
                    self._cached -= len(old)
        return data
