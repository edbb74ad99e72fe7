"""A scrub of the node cache: every chunk file hashed against the id it is named by, every
materialised file against its sha256, and whatever fails dropped (it is fetched again when next
needed), as is anything but a plain file at such a name, and anything but a directory at a shard's
name (chunks/ab). Loads and pulls check what they use as they go; a scrub finds damage in the rest
before a load does, and tells an operator that a node's disk is losing bytes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from mfsreg.registry.client.cache import NodeCache
from mfsreg.registry.client.cachefiles import is_temp, may_replace, unreadable
from mfsreg.registry.format.chunking import MappedFile, chunk_id, file_sha256
from mfsreg.registry.progress import NullProgress, Progress


def verify_cache(cache: NodeCache, progress: Progress | None = None) -> dict:
    """Hash everything the cache holds; drop what does not match its name. Returns what was checked
    and what was dropped."""
    # (over 60 lines: the listing, the hashing and the drops share the progress and the counts)
    progress = progress or NullProgress()
    found = []
    for kind, e in cache.disk_files():
        if not is_temp(e.name):
            try:
                found.append((kind, e, e.stat(follow_symlinks=False).st_size))
            except FileNotFoundError:
                continue  # evicted by a pull since the listing
    progress.start("verify", sum(size for _, _, size in found))
    damaged: dict[str, list[str]] = {"chunk": [], "file": [], "dir": []}
    for kind, e, size in found:
        try:
            with MappedFile(Path(e.path)) as mf:
                ok = (chunk_id(mf.view) if kind == "chunk" else file_sha256(mf.view)) == e.name
                seen = mf.opened  # the file hashed (a stat before the open could name another)
        except FileNotFoundError:
            continue  # evicted meanwhile
        except PermissionError as exc:  # as a pull takes it: damage where it may be replaced
            if not may_replace(e.path):
                raise unreadable(e.path, exc) from None
            try:
                ok, seen = False, os.stat(e.path, follow_symlinks=False)
            except FileNotFoundError:
                continue
        if not ok:
            # only the file found damaged: a good copy another process fetched meanwhile stays
            (cache.discard if kind == "chunk" else cache.discard_file)(e.name, seen)
            if e.path not in (str(cache.chunk_path(e.name)), str(cache.file_path(e.name))):
                Path(e.path).unlink(missing_ok=True)  # a stray file in another subdirectory than its name's
            damaged[kind].append(e.name)
        progress.advance("verify", size)
    for kind, e in cache.disk_others():
        # a directory or link at a chunk's or file's name (made by hand, or by another tool):
        # removed, with its row, so that the next pull writes the file there
        if e.is_dir(follow_symlinks=False):
            shutil.rmtree(e.path)  # one it cannot remove is an OSError naming it, for the operator
        else:
            Path(e.path).unlink(missing_ok=True)
        # its rows, unless a pull has put the good file there since
        if e.path in (str(cache.chunk_path(e.name)), str(cache.file_path(e.name))) and not os.path.lexists(e.path):
            (cache.discard if kind == "chunk" else cache.discard_file)(e.name)
        damaged[kind].append(e.name)
    for e in cache.shard_blockers():
        # a file (or link, fifo) where a shard directory goes: its chunks were lost with the
        # directory, and none could be written there again
        if cache.clear_shard(e.name):
            cache.forget_missing(e.name)
            damaged["dir"].append(f"chunks/{e.name}")
    # what passed and has no row (a writer killed, or an index write that failed on a full disk):
    # recorded, so that stats and the size limit count it again
    orphans = cache.record_orphans()
    return {
        "chunks": sum(k == "chunk" for k, _, _ in found),
        "files": sum(k == "file" for k, _, _ in found),
        "bytes": sum(size for _, _, size in found),
        "damaged_chunks": damaged["chunk"],
        "damaged_files": damaged["file"],
        "damaged_dirs": damaged["dir"],
        "unrecorded_files_found": orphans,
    }
