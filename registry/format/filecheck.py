"""A written file checked against its chunks where they lie, and its writeback started early.

CheckedFile is the file a pull writes: a temp name beside the target, sized up front, its finished
stretches handed to writeback (and, where asked, hashed back against their chunks' ids), then synced
and renamed into place. check_tiling and bad_chunks are the checks.
See docs/design/format.md.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from pathlib import Path

from mfsreg.registry.errors import IntegrityError
from mfsreg.registry.format.chunking import ChunkRef, chunk_id
from mfsreg.registry.format.durable import Placing, create_beside, replaced_mode, sync_dir, temp_beside
from mfsreg.registry.format.manifest import FileEntry

BATCH_BYTES = 64 << 20  # bytes written before a stretch is handed to writeback and to the check


def check_tiling(entry: FileEntry) -> list[ChunkRef]:
    """The file's chunks in offset order, each starting where the previous ends, from 0 to its size."""
    chunks = sorted(entry.chunks, key=lambda c: c.offset)
    pos = 0
    for c in chunks:
        if c.offset != pos or c.size < 0:
            raise IntegrityError(
                f"{entry.path}: the manifest's chunks do not cover the file exactly "
                f"(a chunk at byte {c.offset}, expected {pos}): the registry's record is damaged"
            )
        pos += c.size
    if pos != entry.size:
        raise IntegrityError(
            f"{entry.path}: the manifest's chunks cover {pos} bytes of a {entry.size}-byte file: "
            "the registry's record is damaged"
        )
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


def write_at(fd: int, data, offset: int) -> None:
    """All of ``data`` at ``offset`` (pwrite may write less than it is given)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


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


class CheckedFile:
    """A file written at its chunks' offsets under a temp name beside ``dest``, sized up front.
    Each finished stretch goes to writeback and to a check on ``pool`` (``finished``); ``commit``
    syncs the file and renames it into place (or hands it to a ``Placing`` to be renamed with the
    pull's other files); leaving the ``with`` block otherwise removes it, once no check still reads it.
    The temp file is made as the block is entered, not when the object is: a SIGTERM (raised as
    KeyboardInterrupt) is checked for as ``__enter__`` starts, and landing there it left a file no
    ``__exit__`` would remove."""

    def __init__(self, dest: Path, size: int, pool: Executor, mode: int | None = None):
        dest.parent.mkdir(parents=True, exist_ok=True)
        self.dest = dest
        # set before the rename: the file never appears under ``dest`` with another; None: that
        # of the file it replaces, if any (replaced_mode)
        self.mode = mode
        self.tmp = temp_beside(dest)
        self.pool = pool
        self.checks: list[Future] = []
        self.handed = False
        # sync_file_range starts writeback but blocks while the disk's queue is full: on a thread of
        # its own, for files of more than one stretch, so that the writes go on meanwhile (an Intel
        # Xeon VM's node pull of 1.16 GB spent 0.25 of its 1.5 s there; on the thread, the pull took
        # 1.39 s against 1.55, medians of 8 alternating runs). A pool's thread would delay its
        # decoding; smaller files start theirs inline.
        self._writeback = (
            ThreadPoolExecutor(1, thread_name_prefix="mfsreg-writeback")
            if size > BATCH_BYTES and _sync_file_range is not None
            else None
        )
        self.fd = -1
        self.size = size

    def start_writeback(self, batch: list[ChunkRef]) -> None:
        """Writeback of a written stretch started, on the file's writeback thread where it has one."""
        if self._writeback is not None:
            self._writeback.submit(start_writeback, self.fd, batch)
        else:
            start_writeback(self.fd, batch)

    def finished(self, batch: list[ChunkRef]) -> None:
        self.start_writeback(batch)
        self.checks.append(self.pool.submit(bad_chunks, self.fd, batch))

    def _stop_writeback(self) -> None:
        """Wait for the writeback calls queued: none may use the descriptor once it closes."""
        if self._writeback is not None:
            self._writeback.shutdown(wait=True)
            self._writeback = None

    def bad(self) -> list[ChunkRef]:
        """The chunks that failed their check, once every check is done."""
        return [c for f in self.checks for c in f.result()]

    def commit(self, placing: Placing | None = None) -> None:
        self._stop_writeback()
        mode = self.mode if self.mode is not None else replaced_mode(self.dest)
        if mode is not None:
            os.fchmod(self.fd, mode)
        os.fsync(self.fd)
        if placing is not None:
            placing.add(self.tmp, self.dest, self.fd)  # which keeps its lock until it is renamed
            self.handed = True
        os.close(self.fd)
        self.fd = -1
        if placing is not None:
            return
        os.replace(self.tmp, self.dest)
        sync_dir(self.dest.parent)

    def close(self) -> None:
        for f in self.checks:  # on an error, no check may still map the file when its descriptor closes
            f.cancel()
        wait(self.checks)
        self._stop_writeback()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if not self.handed:  # a Placing renames it, or removes it
            self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> CheckedFile:
        try:  # from the open: a SIGTERM's KeyboardInterrupt lands the moment the file appears
            self.fd = create_beside(self.tmp, self.dest, os.O_RDWR)
            os.ftruncate(self.fd, self.size)  # checks map finished stretches while later ones are written
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()
