"""A file assembled from the node cache, every chunk checked against its id on the way.

With its chunks cached, a pull is a copy of a gigabyte or more. Read into the process and written
back, every byte crossed user memory twice, and a whole-file sha256 over the same bytes (about
1 GB/s here) set the pace. Two ways remain, both checking each chunk by xxh3-128:

- Through the page cache (the default): each chunk file is copied into its place by
  copy_file_range (inside the kernel: page cache to page cache, or shared blocks where the
  filesystem clones), and each finished stretch is checked where it lies in the new file
  (registry/filecheck.py) on another core while the next is copied. Whoever reads the file next
  (an engine, a copy to elsewhere) finds it in memory.
- Direct (MFSREG_PULL_DIRECT=1, for files of DIRECT_MIN_BYTES or more, where the filesystem takes
  O_DIRECT): each chunk file is read into a staging buffer and checked there, and full buffers go
  straight to the disk (registry/client/direct.py). No page cache is filled for the new file, so
  the pull costs one pass through memory and the disk's own time, and the node's memory keeps one
  copy of the bytes (its chunk files), not two; but the file's next reader reads it from disk.
  benchmarks/pull_then_load.py measured the pull (1.16 GB) 0.08 to 0.14 s faster and at two thirds
  of the client's CPU, and the load after it about a second slower, so it is for nodes short of
  memory, or files kept for later.

A cache file found damaged (or cut short) is dropped from the cache, fetched again and placed again, once.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path

from registry.chunking import ChunkRef, chunk_hasher
from registry.client.cache import NodeCache
from registry.client.direct import DirectFile
from registry.filecheck import BATCH_BYTES, CheckedFile, bad_chunks, check_tiling, write_at
from registry.manifest import FileEntry
from registry.parallel import sized_batches
from registry.progress import Progress

COPY_BUFFER = 1 << 20  # read/write fallback
# Smaller files (configs, tokenizers) go through the page cache: an engine reads them again at once,
# and one round trip to the disk per small file would cost more than the copy it saves.
DIRECT_MIN_BYTES = 256 << 10

# copy_file_range fails with these where it cannot copy between the two files (another
# filesystem on older kernels, a filesystem without it, a sandbox that forbids it): copy by hand.
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM, errno.EBADF}


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
                write_at(self.fd, view[:n], c.offset + done)
                done += n
            return True
        finally:
            os.close(src)


def direct_writes() -> bool:
    """Whether pulls write their big files around the page cache: MFSREG_PULL_DIRECT set to anything
    but 0/false/no/off (unset: no)."""
    value = os.environ.get("MFSREG_PULL_DIRECT", "").strip().lower()
    return bool(value) and value not in ("0", "false", "no", "off")


def write_file(entry: FileEntry, dest: Path, cache: NodeCache, refetch: Callable[[list[str]], None],
               pool: Executor, progress: Progress, arriving: Callable[[str], None] | None = None,
               mode: int | None = None, direct: bool = False) -> None:
    """Write ``entry`` to ``dest`` atomically from cached chunks, each checked against its id.

    ``arriving(id)``, when given, waits for a chunk that a fetch running alongside has not landed
    yet. ``refetch(ids)`` drops chunks' cache files and fetches them again (another process
    evicted them meanwhile, or they failed the check). ``mode``: the file's permissions as it
    appears. ``direct``: write around the page cache if the file is big enough and the filesystem
    takes it (``direct_writes`` says what the user asked for)."""
    chunks = check_tiling(entry)
    if direct and entry.size >= DIRECT_MIN_BYTES:
        out = DirectFile.open(dest, entry.size, mode)
        if out is not None:
            with out:
                _write_direct(out, chunks, cache, refetch, progress, arriving)
            return
    _write_buffered(entry, chunks, dest, cache, refetch, pool, progress, arriving, mode)


_MISSING, _DAMAGED, _PLACED = range(3)


def _stage(out: DirectFile, cache: NodeCache, c: ChunkRef) -> int:
    """Stage chunk ``c`` from its cache file, checked as it lands; taken back unless it is whole and
    hashes to its id."""
    try:
        src = os.open(cache.chunk_file(c.id), os.O_RDONLY)
    except FileNotFoundError:
        return _MISSING
    try:
        if os.fstat(src).st_size != c.size:
            return _DAMAGED  # cache files appear whole (renamed into place): this one was changed
        mark = out.mark()
        h = chunk_hasher()
        if out.stage_from(src, c.size, h.update) == c.size and h.hexdigest() == c.id:
            return _PLACED
        out.rollback(mark)
        return _DAMAGED
    finally:
        os.close(src)


def _write_direct(out: DirectFile, chunks: list[ChunkRef], cache: NodeCache, refetch: Callable[[list[str]], None],
                  progress: Progress, arriving: Callable[[str], None] | None) -> None:
    for c in chunks:
        got = _stage(out, cache, c)
        if got == _MISSING and arriving is not None:
            arriving(c.id)
            got = _stage(out, cache, c)
        if got != _PLACED:
            # Missing (another process evicted it) or damaged: fetched anew, one at a time, as it is
            # met; nothing of it was written, so the file goes on in order.
            refetch([c.id])
            if _stage(out, cache, c) != _PLACED:
                raise cache.failed_again(c.id)
        out.settle()
        progress.advance("write", c.size)
    out.commit()


def _write_buffered(entry: FileEntry, chunks: list[ChunkRef], dest: Path, cache: NodeCache,
                    refetch: Callable[[list[str]], None], pool: Executor, progress: Progress,
                    arriving: Callable[[str], None] | None, mode: int | None) -> None:
    with CheckedFile(dest, entry.size, pool, mode) as out:
        copier = _Copier(cache, out.fd)

        def place(c: ChunkRef) -> None:
            if copier.copy(c):
                return
            if arriving is not None:
                arriving(c.id)
                if copier.copy(c):
                    return
            refetch([c.id])  # missing, or a file of the wrong size: either way fetched anew
            if not copier.copy(c):
                raise cache.failed_again(c.id)

        for batch in sized_batches(chunks, lambda c: c.size, BATCH_BYTES):
            for c in batch:
                place(c)
            out.finished(batch)
            progress.advance("write", sum(c.size for c in batch))
        bad = out.bad()
        if bad:  # damaged on the node's disk: dropped and fetched again in one go, copied again, once
            refetch(list(dict.fromkeys(c.id for c in bad)))  # a chunk used twice in the file is fetched once
            for c in bad:
                if not copier.copy(c) or bad_chunks(out.fd, [c]):
                    raise cache.failed_again(c.id)
        out.commit()
