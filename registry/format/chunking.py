"""Chunk plans: where a file is cut, and the digests of the pieces.

A safetensors file is cut into its header (length prefix plus JSON, kept verbatim) and then each
tensor's bytes into pieces of at most ``chunk_size`` bytes, cut at element boundaries so that every
chunk is a whole number of elements (a delta or a GPU copy never splits one). Any other file is cut
into plain pieces. Hashing reads memoryviews over an mmap: no copies of the data are made.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Protocol

import xxhash

from mfsreg.registry.format.safetensors import TensorSpan

_busguard: ModuleType | None
try:
    from mfsreg.registry.format import _busguard  # C, built by setup.py where a compiler is at hand
except ImportError:  # without it, a file cut short while it is pushed ends the push with SIGBUS
    _busguard = None


@dataclass(frozen=True)
class ChunkRef:
    """A piece of a file: its id (xxh3-128 hex of the raw bytes), offset, size and element width."""

    id: str
    offset: int
    size: int
    itemsize: int = 1


@dataclass(frozen=True)
class Cut:
    offset: int
    size: int
    itemsize: int


class CutHeader(Protocol):
    """What a plan reads of a safetensors header: a SafetensorsHeader, or one rebuilt from a manifest."""

    @property
    def header_size(self) -> int: ...

    @property
    def tensors(self) -> tuple[TensorSpan, ...]: ...


def plan_cuts(file_size: int, header: CutHeader | None, chunk_size: int) -> list[Cut]:
    """The byte ranges a file is cut into, in file order, covering it exactly."""
    return list(iter_cuts(file_size, header, chunk_size))


def iter_cuts(file_size: int, header: CutHeader | None, chunk_size: int) -> Iterator[Cut]:
    """plan_cuts one cut at a time (in the header's tensor order): a server compares a client's
    manifest with it and stops at the first cut that differs, whatever size the manifest claims."""
    if header is None:
        yield from (Cut(o, min(chunk_size, file_size - o), 1) for o in range(0, file_size, chunk_size))
        return
    yield Cut(0, header.header_size, 1)
    for t in header.tensors:
        step = max(t.itemsize, chunk_size - chunk_size % t.itemsize)
        yield from (Cut(o, min(step, t.end - o), t.itemsize) for o in range(t.start, t.end, step))


def chunk_id(data) -> str:
    """The id of a chunk: xxh3-128 of its raw bytes, as 32 hex digits."""
    return xxhash.xxh3_128_hexdigest(data)


def chunk_hasher():
    """chunk_id's hash fed piece by piece: ``update(piece)``, then ``hexdigest()`` is the id."""
    return xxhash.xxh3_128()


class MappedFile:
    """A read-only mmap of a file (an empty file maps to an empty buffer), and whether the file has
    changed since it was opened (``changed``): a push reads a file that something else may still be
    writing (a trainer saving its checkpoint)."""

    def __init__(self, path: Path):
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        try:
            self.opened = os.fstat(self._fd)  # the file mapped, as it was when opened
            self.size = self.opened.st_size
            self._mm = mmap.mmap(self._fd, self.size, access=mmap.ACCESS_READ) if self.size else None
        except BaseException:
            os.close(self._fd)
            raise
        if self._mm is not None:
            self._mm.madvise(mmap.MADV_SEQUENTIAL)
        # a read past the end of a file cut short raises SIGBUS, which would end the process:
        # registry/format/_busguard.c answers such reads of this map with zeros and remembers it
        self._guard = _busguard.guard(self._mm) if _busguard is not None and self._mm is not None else -1
        self.view = memoryview(self._mm) if self._mm is not None else memoryview(b"")

    def changed(self) -> str | None:
        """Why the bytes read through the map may not be the file's as it was opened, or None: a
        read past its end (it was cut short while it was read), a read that failed, or a change of
        its size or modification time (not its ctime). A write in the same timestamp tick as the
        opening may not show.
        See docs/design/format.md."""
        now = os.fstat(self._fd)
        if self._guard >= 0 and _busguard is not None and _busguard.hit(self._guard):
            if now.st_size < self.size:
                return "it was cut short while it was read"
            # a read error of a page (a failing disk, a network filesystem's EIO) also ends in SIGBUS
            return "a read of it failed, or it was cut short and written again, while it was read"
        if now.st_size != self.opened.st_size:
            return f"its size went from {self.opened.st_size} to {now.st_size} bytes"
        if now.st_mtime_ns != self.opened.st_mtime_ns:
            return "it was written to"
        return None

    def close(self, failing: bool = False) -> None:
        """Unmap and close. ``failing``: an error is on its way out, and the frames it keeps (of a
        chunk's encoding, say) may still hold slices of the map; closing would then raise over that
        error, so the map is left to be unmapped when its last slice goes. Otherwise a slice still
        alive is a leak, and raises BufferError."""
        self.view.release()
        if self._guard >= 0 and _busguard is not None:  # a slot is only ever taken through it
            # dropped even where the map outlives this call (below): a span left noted could
            # later answer a real fault of another map at the same addresses with zeros
            _busguard.release(self._guard)
            self._guard = -1
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                if not failing:
                    raise
            self._mm = None
        os.close(self._fd)

    def __enter__(self) -> MappedFile:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(failing=exc_type is not None)


def file_sha256(view: memoryview, cancel: threading.Event | None = None) -> str | None:
    """sha256 of ``view``; None if ``cancel`` is set first (checked between 16 MiB blocks)."""
    h = hashlib.sha256()
    step = 16 << 20
    for o in range(0, len(view), step):
        if cancel is not None and cancel.is_set():
            return None
        h.update(view[o : o + step])  # hashlib releases the GIL on large buffers
    return h.hexdigest()
