"""A file assembled from the node cache: chunk files copied by the kernel, then checked where they lie.

With its chunks cached, a pull is a copy of a gigabyte or more. Read into the process and written
back, every byte crossed user memory twice, and a whole-file sha256 over the same bytes (about
1 GB/s here) set the pace. Here each chunk file is copied into its place by copy_file_range (inside
the kernel: page cache to page cache, or shared blocks where the filesystem clones), and each
finished stretch is checked where it lies in the new file (registry/filecheck.py) on another core
while the next is copied. The check reads the bytes as the file holds them, so a cache file
damaged on disk is caught too: it is dropped from the cache, fetched again and copied again, once.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path

from registry.chunking import ChunkRef
from registry.client.cache import NodeCache
from registry.filecheck import BATCH_BYTES, CheckedFile, bad_chunks, check_tiling, write_at
from registry.manifest import FileEntry
from registry.parallel import sized_batches
from registry.progress import Progress

COPY_BUFFER = 1 << 20  # read/write fallback

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


def write_file(entry: FileEntry, dest: Path, cache: NodeCache, refetch: Callable[[list[str]], None],
               pool: Executor, progress: Progress, arriving: Callable[[str], None] | None = None,
               mode: int | None = None) -> None:
    """Write ``entry`` to ``dest`` atomically from cached chunks, each checked in place against its id.

    ``arriving(id)``, when given, waits for a chunk that a fetch running alongside has not landed
    yet. ``refetch(ids)`` drops chunks' cache files and fetches them again (another process
    evicted them meanwhile, or they failed the check). ``mode``: the file's permissions as it appears."""
    chunks = check_tiling(entry)
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
