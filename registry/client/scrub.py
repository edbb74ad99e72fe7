"""A scrub of the node cache: every chunk file hashed against the id it is named by, every
materialised file against its sha256, and whatever fails dropped (it is fetched again when next
needed). Loads and pulls check what they use as they go; a scrub finds damage in the rest before
a load does, and tells an operator that a node's disk is losing bytes."""

from __future__ import annotations

import hashlib
import os

from registry.chunking import chunk_id
from registry.client.cache import NodeCache
from registry.progress import NullProgress, Progress

READ_BYTES = 8 << 20  # materialised files are hashed in pieces of this size


def _listing(root: str) -> list[os.DirEntry]:
    """Plain files under ``root`` (one level of subdirectories for chunks), temp files left out."""
    try:
        top = list(os.scandir(root))
    except FileNotFoundError:
        return []
    out = []
    for e in top:
        if e.is_dir(follow_symlinks=False):
            out.extend(f for f in os.scandir(e.path) if f.is_file(follow_symlinks=False) and not f.name.startswith("."))
        elif e.is_file(follow_symlinks=False) and not e.name.startswith("."):
            out.append(e)
    return out


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while piece := f.read(READ_BYTES):
            h.update(piece)
    return h.hexdigest()


def verify_cache(cache: NodeCache, progress: Progress | None = None) -> dict:
    """Hash everything the cache holds; drop what does not match its name. Returns what was checked
    and what was dropped."""
    progress = progress or NullProgress()
    chunks = _listing(str(cache.root / "chunks"))
    files = _listing(str(cache.root / "files"))
    sizes = {e.path: e.stat(follow_symlinks=False).st_size for e in chunks + files}
    progress.start("verify", sum(sizes.values()))
    bad_chunks, bad_files = [], []
    for e in chunks:
        try:
            with open(e.path, "rb", buffering=0) as f:
                ok = chunk_id(f.read()) == e.name
        except FileNotFoundError:
            continue  # evicted meanwhile
        if not ok:
            cache.discard(e.name)
            _unlink(e.path)  # a stray file in another subdirectory than its name's: gone all the same
            bad_chunks.append(e.name)
        progress.advance("verify", sizes[e.path])
    for e in files:
        try:
            ok = _sha256(e.path) == e.name
        except FileNotFoundError:
            continue
        if not ok:
            cache.discard_file(e.name)
            bad_files.append(e.name)
        progress.advance("verify", sizes[e.path])
    return {"chunks": len(chunks), "files": len(files), "bytes": sum(sizes.values()),
            "damaged_chunks": bad_chunks, "damaged_files": bad_files}
