"""Where the node cache keeps its entries under its root: chunks/ab/<id>, files/<sha256> and
index.db, and the walks of what stands on disk (registry/client/cache.py composes it with the index
and eviction)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

from mfsreg.registry.client.cachefiles import CHUNK_NAME, FILE_NAME, SHARD_NAME, STALE_TEMP_SECONDS, is_temp, make_dir


class CacheLayout:
    """The paths of a node cache's entries, and what stands at them."""

    def __init__(self, root: Path):
        self.root = root
        self.chunks = str(root / "chunks")  # a plain string: loads join a thousand names or more
        self.files = root / "files"
        self.index = root / "index.db"

    def make(self) -> None:
        make_dir(self.root / "chunks")
        make_dir(self.files)

    def chunk_path(self, chunk_id: str) -> Path:
        return Path(self.chunk_file(chunk_id))

    def chunk_file(self, chunk_id: str) -> str:
        """The chunk's file as a plain string: loads look up a thousand chunks or more, and pathlib's
        joins cost more than the stat itself."""
        return f"{self.chunks}/{chunk_id[:2]}/{chunk_id}"

    def file_path(self, sha256: str) -> Path:
        return self.files / sha256

    # -- on disk ----------------------------------------------------------------------------------

    def disk_files(self) -> Iterator[tuple[str, os.DirEntry]]:
        """Every plain file on disk, temp files included: ("chunk", entry) for those under chunks/
        (one level of subdirectories), ("file", entry) for materialised files."""
        return ((kind, e) for kind, e in self._disk_entries() if e.is_file(follow_symlinks=False))

    def disk_others(self) -> Iterator[tuple[str, os.DirEntry]]:
        """What stands at a chunk's or a materialised file's place and is not a plain file (a
        directory, a link, a fifo): no writer makes these, and each would stop that file being
        written (a rename onto a directory fails) while a listing of plain files passes it over."""
        for kind, e in self._disk_entries():
            named = CHUNK_NAME if kind == "chunk" else FILE_NAME
            if named.fullmatch(e.name) and not e.is_file(follow_symlinks=False):
                yield kind, e

    def shard_blockers(self) -> Iterator[os.DirEntry]:
        """What stands at a shard directory's name in chunks/ (two hex digits) and is not a
        directory: a file, a link, a fifo. No writer makes these; listings pass them over, and
        each stops every chunk of its shard being written."""
        for e in os.scandir(self.chunks):
            if SHARD_NAME.fullmatch(e.name) and not e.is_dir(follow_symlinks=False):
                yield e

    def _disk_entries(self) -> Iterator[tuple[str, os.DirEntry]]:
        """Every entry in chunks/' subdirectories ("chunk") and in files/ ("file")."""
        for kind, top, nested in (("chunk", self.chunks, True), ("file", str(self.files), False)):
            dirs = [e.path for e in os.scandir(top) if e.is_dir(follow_symlinks=False)] if nested else [top]
            for d in dirs:
                try:
                    entries = list(os.scandir(d))
                except FileNotFoundError:
                    continue
                yield from ((kind, e) for e in entries)

    def sweep_temps(self, older_than: float = STALE_TEMP_SECONDS) -> int:
        """Remove temp files that writers left behind (a process killed mid-write) once they are
        ``older_than`` seconds old: a live writer renames its temp file within seconds. Returns
        how many went."""
        cutoff = time.time() - older_than
        removed = 0
        for _, e in self.disk_files():
            if is_temp(e.name):
                try:
                    if e.stat(follow_symlinks=False).st_mtime < cutoff:
                        os.unlink(e.path)
                        removed += 1
                except FileNotFoundError:
                    pass  # renamed or removed meanwhile
        return removed
