"""A file assembled from the node cache, every chunk checked against its id on the way.

Each chunk file is read into a buffer of the process, checked there, and written: through the page
cache (the default: registry/format/filecheck.py's CheckedFile), or around it (MFSREG_PULL_DIRECT=1, files
of DIRECT_MIN_BYTES or more: registry/client/direct.py). A cache file found damaged, cut short or
gone is dropped, fetched again and placed again, once; nothing of it is written before it passes.
See docs/design/node-cache.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path

from mfsreg.registry.client.cache import NodeCache
from mfsreg.registry.client.cachefiles import open_plain
from mfsreg.registry.client.direct import DirectFile
from mfsreg.registry.format.chunking import ChunkRef, chunk_hasher, chunk_id
from mfsreg.registry.format.durable import Placing, writing
from mfsreg.registry.format.filecheck import BATCH_BYTES, CheckedFile, check_tiling, write_at
from mfsreg.registry.format.manifest import FileEntry
from mfsreg.registry.parallel import sized_batches
from mfsreg.registry.progress import Progress

# Smaller files (configs, tokenizers) go through the page cache: an engine reads them again at once,
# and one round trip to the disk per small file would cost more than the copy it saves.
DIRECT_MIN_BYTES = 256 << 10


def direct_writes() -> bool:
    """Whether pulls write their big files around the page cache: MFSREG_PULL_DIRECT set to anything
    but 0/false/no/off (unset: no)."""
    value = os.environ.get("MFSREG_PULL_DIRECT", "").strip().lower()
    return bool(value) and value not in ("0", "false", "no", "off")


def write_file(
    entry: FileEntry,
    dest: Path,
    cache: NodeCache,
    refetch: Callable[[list[str]], None],
    pool: Executor,
    progress: Progress,
    arriving: Callable[[str], None] | None = None,
    mode: int | None = None,
    placing: Placing | None = None,
) -> None:
    """Write ``entry`` to ``dest`` atomically from cached chunks, each checked against its id.

    ``arriving(id)`` waits for a chunk a fetch alongside has yet to land; ``refetch(ids)`` fetches
    chunks again. ``mode``: the file's permissions (None: the replaced file's, else the umask's).
    ``placing``: renames it with the pull's other files (else at once). A big file goes around the
    page cache where ``direct_writes()`` and the filesystem allow."""
    with writing(dest):
        _write_file(entry, dest, cache, refetch, pool, progress, arriving, mode, placing)


def _write_file(
    entry: FileEntry,
    dest: Path,
    cache: NodeCache,
    refetch: Callable[[list[str]], None],
    pool: Executor,
    progress: Progress,
    arriving: Callable[[str], None] | None,
    mode: int | None,
    placing: Placing | None,
) -> None:
    chunks = check_tiling(entry)
    if placing is not None:
        placing.make_dirs(dest.parent)
    if entry.size >= DIRECT_MIN_BYTES and direct_writes():
        direct = DirectFile.open(dest, entry.size, mode)
        if direct is not None:
            # try/finally rather than `with`: a SIGTERM (raised as KeyboardInterrupt) is checked for
            # as __enter__ starts, where no __exit__ would remove the temp file open() made
            try:
                _place_all(
                    chunks,
                    lambda c: _from_cache(cache, c, lambda src: _stage_checked(direct, c, src)),
                    cache,
                    refetch,
                    arriving,
                    lambda batch: None,
                    progress,
                )
                direct.commit(placing)
            finally:
                direct.close()
            return
    with CheckedFile(dest, entry.size, pool, mode) as out:
        buf = bytearray(max((c.size for c in chunks), default=0))  # one chunk at a time: it stays in the CPU's cache
        with memoryview(buf) as view:
            _place_all(
                chunks,
                lambda c: _from_cache(cache, c, lambda src: _write_checked(view, out.fd, c, src)),
                cache,
                refetch,
                arriving,
                out.start_writeback,
                progress,
            )
        out.commit(placing)


_MISSING, _DAMAGED, _PLACED = range(3)


def _from_cache(cache: NodeCache, c: ChunkRef, place: Callable[[int], bool]) -> int:
    """Chunk ``c``'s cache file, open, handed to ``place(fd)``, which reads, checks and places it
    and says whether it passed: _PLACED, _DAMAGED, or _MISSING where the file is gone."""
    path = cache.chunk_file(c.id)
    opened = open_plain(path)
    if opened is None:  # gone, or something that is not a plain file stands there (a fifo, a link)
        return _DAMAGED if os.path.lexists(path) else _MISSING
    src, st = opened
    try:
        if st.st_size != c.size:
            return _DAMAGED  # cache files appear whole (renamed into place): this one was changed
        return _PLACED if place(src) else _DAMAGED
    finally:
        os.close(src)


def _write_checked(view: memoryview, fd: int, c: ChunkRef, src: int) -> bool:
    """Read chunk ``c`` into ``view``, and write it at its offset in the file open as ``fd`` only
    if it hashes to its id."""
    with view[: c.size] as piece:
        if os.preadv(src, [piece], 0) != c.size or chunk_id(piece) != c.id:
            return False
        write_at(fd, piece, c.offset)
    return True


def _stage_checked(out: DirectFile, c: ChunkRef, src: int) -> bool:
    """Stage chunk ``c``, checked as it lands; taken back unless it is whole and hashes to its id."""
    mark = out.mark()
    h = chunk_hasher()
    if out.stage_from(src, c.size, h.update) == c.size and h.hexdigest() == c.id:
        out.settle()  # full buffers go to the writer as soon as what they hold is checked
        return True
    out.rollback(mark)
    return False


def _place_all(
    chunks: list[ChunkRef],
    place: Callable[[ChunkRef], int],
    cache: NodeCache,
    refetch: Callable[[list[str]], None],
    arriving: Callable[[str], None] | None,
    finished: Callable[[list[ChunkRef]], None],
    progress: Progress,
) -> None:
    """Every chunk placed in order by ``place``; ``finished(batch)`` after each stretch."""
    for batch in sized_batches(chunks, lambda c: c.size, BATCH_BYTES):
        for c in batch:
            got = place(c)
            if got == _MISSING and arriving is not None:  # the fetch beside us has not landed it yet
                arriving(c.id)
                got = place(c)
            if got != _PLACED:
                # Gone (another process evicted it) or damaged: fetched anew as it is met, one at a
                # time; nothing of it was written, so the file goes on in order.
                refetch([c.id])
                if place(c) != _PLACED:
                    raise cache.failed_again(c.id)
        finished(batch)
        progress.advance("write", sum(c.size for c in batch))
