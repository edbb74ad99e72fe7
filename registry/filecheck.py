"""A written file checked against its chunks where they lie, and its writeback started early.

Both pulls (the embedded one from packs, registry/rebuild.py, and a node's from its cache,
registry/client/assemble.py) write a file chunk by chunk at the chunks' offsets and then hash each
finished stretch, read back from the file, with xxh3-128 against its chunks' ids. The chunks are
first checked to tile the file (every byte lies in exactly one chunk), so a file whose every chunk
hashes to its id is the file the manifest describes: what a whole-file sha256 taken from the same
manifest would prove, at about a tenth of the CPU, and of the bytes as the file holds them rather
than as they were handed to write().
"""

from __future__ import annotations

import ctypes
import mmap

from registry.chunking import ChunkRef, chunk_id
from registry.errors import IntegrityError
from registry.manifest import FileEntry

BATCH_BYTES = 64 << 20  # bytes written before a stretch is handed to writeback and to the check


def check_tiling(entry: FileEntry) -> list[ChunkRef]:
    """The file's chunks in offset order, each starting where the previous ends, from 0 to its size."""
    chunks = sorted(entry.chunks, key=lambda c: c.offset)
    pos = 0
    for c in chunks:
        if c.offset != pos or c.size < 0:
            raise IntegrityError(f"{entry.path}: the manifest's chunks do not cover the file exactly "
                                 f"(a chunk at byte {c.offset}, expected {pos}): the registry's record is damaged")
        pos += c.size
    if pos != entry.size:
        raise IntegrityError(f"{entry.path}: the manifest's chunks cover {pos} bytes of a {entry.size}-byte file: "
                             "the registry's record is damaged")
    return chunks


def bad_chunks(fd: int, batch: list[ChunkRef]) -> list[ChunkRef]:
    """Chunks of ``batch`` (consecutive, in offset order) whose bytes, read back from the file
    open as ``fd``, do not hash to their id."""
    end = batch[-1].offset + batch[-1].size if batch else 0
    if end == 0:
        return []  # nothing but empty chunks, or none: nothing to map
    start = batch[0].offset // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
    with mmap.mmap(fd, end - start, prot=mmap.PROT_READ, offset=start) as m:
        view = memoryview(m)
        try:
            return [c for c in batch if chunk_id(view[c.offset - start : c.offset - start + c.size]) != c.id]
        finally:
            view.release()


def _libc_sync_file_range():
    """Linux's sync_file_range, which Python's os module lacks; None elsewhere."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, batch: list[ChunkRef]) -> None:
    """Ask the kernel to start writing ``batch``'s bytes to disk now, without waiting: the fsync
    before the rename then finds most of the file clean."""
    if _sync_file_range is not None and batch:
        length = batch[-1].offset + batch[-1].size - batch[0].offset
        if length > 0:
            _sync_file_range(fd, batch[0].offset, length, _SYNC_FILE_RANGE_WRITE)  # a hint: errors change nothing
