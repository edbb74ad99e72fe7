"""A file assembled from the node cache: chunk files copied by the kernel, then checked where they lie.

With its chunks cached, a pull is a copy of a gigabyte or more. Read into the process and written
back, every byte crossed user memory twice, and a whole-file sha256 over the same bytes (about
1 GB/s here) set the pace. Here each chunk file is copied into its place by copy_file_range (inside
the kernel: page cache to page cache, or shared blocks where the filesystem clones), and each
finished batch is then hashed where it lies in the new file, with xxh3-128, against its chunks'
ids, on another core while the next batch is copied.

That check covers the file: the chunks are first checked to tile it (every byte lies in exactly
one chunk), so a file whose every chunk hashes to its id is the file the manifest describes, which
is what a whole-file sha256 taken from the same manifest would prove, at a tenth of the speed. It
reads the bytes as the file holds them, so a cache file damaged on disk is caught too: it is
dropped from the cache, fetched again and copied again, once.

Dirty pages are handed to writeback as each batch is copied (sync_file_range), so the closing fsync
waits for the tail instead of the whole file.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import uuid
from collections.abc import Callable
from concurrent.futures import Executor, Future, wait
from pathlib import Path

from registry.chunking import ChunkRef, chunk_id
from registry.client.cache import NodeCache
from registry.errors import IntegrityError
from registry.manifest import FileEntry
from registry.parallel import sized_batches
from registry.progress import Progress

BATCH_BYTES = 64 << 20  # bytes copied before the batch is handed to writeback and to the checker
COPY_BUFFER = 1 << 20  # read/write fallback

# copy_file_range fails with these where it cannot copy between the two files (another
# filesystem on older kernels, a filesystem without it, a sandbox that forbids it): copy by hand.
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM, errno.EBADF}


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


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing [offset, offset + length) to disk now, without waiting:
    the fsync before the rename then finds most of the file clean."""
    if _sync_file_range is not None and length > 0:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # a hint: errors change nothing


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


class _Copier:
    """Copies cache chunk files into one open output file, with the kernel where it can."""

    def __init__(self, cache: NodeCache, fd: int):
        self.cache = cache
        self.fd = fd
        self.kernel = hasattr(os, "copy_file_range")
        self.buf: bytearray | None = None

    def copy(self, c: ChunkRef) -> bool:
        """Copy chunk ``c`` to its offset; False if the cache lacks it (or holds a file of another size)."""
        try:
            src = os.open(self.cache.chunk_file(c.id), os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            if os.fstat(src).st_size != c.size:
                return False
            done = 0
            if self.kernel:
                try:
                    while done < c.size:
                        n = os.copy_file_range(src, self.fd, c.size - done, done, c.offset + done)
                        if n == 0:
                            return False  # the file shrank under us
                        done += n
                except OSError as exc:
                    if exc.errno not in _NO_KERNEL_COPY:
                        raise
                    self.kernel = False
            while done < c.size:
                if self.buf is None:
                    self.buf = bytearray(COPY_BUFFER)
                view = memoryview(self.buf)[: min(COPY_BUFFER, c.size - done)]
                n = os.preadv(src, [view], done)
                if n == 0:
                    return False
                os.pwrite(self.fd, view[:n], c.offset + done)
                done += n
            return True
        finally:
            os.close(src)


def _bad_chunks(fd: int, batch: list[ChunkRef]) -> list[ChunkRef]:
    """Chunks of ``batch`` whose bytes, read back from the output file, do not hash to their id."""
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


def write_file(entry: FileEntry, dest: Path, cache: NodeCache, refetch: Callable[[str], None],
               pool: Executor, progress: Progress, arriving: Callable[[str], None] | None = None) -> None:
    """Write ``entry`` to ``dest`` atomically from cached chunks, each checked in place against its id.

    ``arriving(id)``, when given, waits for a chunk that a fetch running alongside has not landed
    yet. ``refetch(id)`` fetches a chunk into the cache again (another process evicted it
    meanwhile, or its cache file failed the check and was dropped)."""
    chunks = check_tiling(entry)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    checks: list[Future] = []
    try:
        os.ftruncate(fd, entry.size)  # sized up front: the checker maps batches while later ones are copied
        copier = _Copier(cache, fd)

        def place(c: ChunkRef) -> None:
            if copier.copy(c):
                return
            if arriving is not None:
                arriving(c.id)
                if copier.copy(c):
                    return
            cache.discard(c.id)  # missing, or a file of the wrong size: either way fetched anew
            refetch(c.id)
            if not copier.copy(c):
                raise IntegrityError(f"chunk {c.id} keeps leaving the node cache: raise MFSREG_CACHE_MAX")

        for batch in sized_batches(chunks, lambda c: c.size, BATCH_BYTES):
            for c in batch:
                place(c)
            start_writeback(fd, batch[0].offset, batch[-1].offset + batch[-1].size - batch[0].offset)
            checks.append(pool.submit(_bad_chunks, fd, batch))
            progress.advance("write", sum(c.size for c in batch))
        bad = [c for f in checks for c in f.result()]
        refreshed: set[str] = set()
        for c in bad:  # damaged on the node's disk: drop it, fetch it again, copy it again, once
            if c.id not in refreshed:  # a chunk used twice in the file is fetched once
                cache.discard(c.id)
                refreshed.add(c.id)
            place(c)
            if _bad_chunks(fd, [c]):
                raise IntegrityError(f"chunk {c.id} does not match its id even after fetching it again: "
                                     "check this node's disk and memory, then retry")
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, dest)
    finally:
        for f in checks:  # on an error, no check may still map the file when its descriptor closes
            f.cancel()
        wait(checks)
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
