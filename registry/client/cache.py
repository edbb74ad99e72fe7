"""The node cache: verified raw chunks on local disk, content-addressed and size-bounded.

Under MFSREG_CACHE_DIR: chunks/ab/<id> (read-only), files/<sha256>, index.db, holders/, evicted/ and the
``unrecorded`` marker. Processes on one node share it: each write goes to a unique temp name and is
renamed into place. This module holds the layout and the chunks' reads, writes and drops; files on
disk, the index and eviction live in cachefiles.py, indexdb.py, cacheindex.py and eviction.py.
See docs/design/node-cache.md.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Set as AbstractSet
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from mfsreg.registry.client.cachefiles import (
    STALE_TEMP_SECONDS,
    atomic_write,
    is_plain,
    make_dir,
    map_plain,
    open_plain,
    read_plain,
    temp_name,
)
from mfsreg.registry.client.cacheindex import CacheIndex
from mfsreg.registry.client.eviction import FILE_RANK, RANK, Eviction, Lease, Leases
from mfsreg.registry.client.indexdb import forget_rows
from mfsreg.registry.client.layout import CacheLayout
from mfsreg.registry.errors import IntegrityError, InvalidRequest, StorageError
from mfsreg.registry.format.chunking import chunk_id as chunk_id_of

# What other modules import from here; the file helpers, index and eviction names are imported
# from their own modules (cachefiles.py, indexdb.py, eviction.py).
__all__ = ["NodeCache", "cache_root", "default_cache_dir", "default_max_bytes", "missing_cache_stats"]


def default_cache_dir() -> Path:
    env = os.environ.get("MFSREG_CACHE_DIR")
    if env:
        return cache_root(env, "MFSREG_CACHE_DIR")
    xdg = os.environ.get("XDG_CACHE_HOME")
    # The XDG spec: a relative path in XDG_CACHE_HOME is invalid and to be ignored (taken as it was,
    # it named another cache in each directory a command ran from).
    if xdg and os.path.isabs(xdg):
        return _no_padding(xdg, "XDG_CACHE_HOME", ", or set MFSREG_CACHE_DIR") / "mfsreg"
    return Path.home() / ".cache" / "mfsreg"


def cache_root(value: str | os.PathLike, name: str = "cache_dir") -> Path:
    """A node cache directory as a user gave it (MFSREG_CACHE_DIR, or cache_dir= of a Node), checked
    the one way for both: ``~`` expands; an empty, relative or space-padded one is refused (a relative
    one, or ' ', named another cache in each directory a command ran from; '/x ' made a directory
    whose name ends in a space)."""
    text = os.fsdecode(os.fspath(value))
    if not text:
        raise InvalidRequest(
            f"{name}='' is empty: give an absolute path, e.g. /var/cache/mfsreg"
            + ("" if name == "MFSREG_CACHE_DIR" else ", or leave it out to use MFSREG_CACHE_DIR")
        )
    from mfsreg.registry.config import expand_user

    path = expand_user(name, text)
    if not path.is_absolute():
        raise InvalidRequest(f"{name}={text!r} is not an absolute path: give one, e.g. /var/cache/mfsreg")
    _no_padding(text, name)
    return path


def _no_padding(text: str, name: str, hint: str = "") -> Path:
    if text != text.strip():
        raise InvalidRequest(
            f"{name}={text!r} starts or ends with a space, which no directory is meant to: remove it{hint}"
        )
    return Path(text)


def default_max_bytes() -> int | None:
    from mfsreg.registry.config import size_from_env

    return size_from_env("MFSREG_CACHE_MAX", None)


class NodeCache:
    """A node cache: its layout on disk (layout.CacheLayout), its index (cacheindex.CacheIndex), its
    leases and its pins and size limit (eviction.Leases, eviction.Eviction), each a part with its own interface; this
    class holds the chunks' reads, writes and drops, and hands the parts' operations on."""

    def __init__(self, root: str | os.PathLike | None = None, max_bytes: int | None = None):
        self.layout = CacheLayout(cache_root(root) if root is not None else default_cache_dir())
        self.root = self.layout.root
        self.layout.make()
        self.index = CacheIndex(self.layout)
        self.leases = Leases(self.index, self.layout)
        self.eviction = Eviction(self.index, self.layout, max_bytes if max_bytes is not None else default_max_bytes())

    @property
    def max_bytes(self) -> int | None:
        return self.eviction.max_bytes

    @max_bytes.setter
    def max_bytes(self, value: int | None) -> None:
        self.eviction.max_bytes = value

    # -- the layout's ------------------------------------------------------------------------------

    def chunk_path(self, chunk_id: str) -> Path:
        return self.layout.chunk_path(chunk_id)

    def chunk_file(self, chunk_id: str) -> str:
        return self.layout.chunk_file(chunk_id)

    def file_path(self, sha256: str) -> Path:
        return self.layout.file_path(sha256)

    def disk_files(self) -> Iterator[tuple[str, os.DirEntry]]:
        return self.layout.disk_files()

    def disk_others(self) -> Iterator[tuple[str, os.DirEntry]]:
        return self.layout.disk_others()

    def shard_blockers(self) -> Iterator[os.DirEntry]:
        return self.layout.shard_blockers()

    def sweep_temps(self, older_than: float = STALE_TEMP_SECONDS) -> int:
        return self.layout.sweep_temps(older_than)

    # -- the index's -------------------------------------------------------------------------------

    def close(self) -> None:
        self.index.close()

    def record(self, items: Iterable[tuple[str, int, str | None, str | None]]) -> None:
        self.index.record(items)

    def touch(self, chunk_ids: Iterable[str]) -> None:
        self.index.touch(chunk_ids)

    def set_tiers(self, tiers: dict[str, str | None], family: str | None = None) -> None:
        self.index.set_tiers(tiers, family)

    def forget_missing(self, prefix: str) -> int:
        return self.index.forget_missing(prefix)

    def forget(self, chunk_ids: list[str]) -> None:
        self.index.forget(chunk_ids)

    def add_file(self, sha256: str, size: int) -> None:
        self.index.add_file(sha256, size)

    def record_pull(self, family: str, version: str) -> None:
        self.index.record_pull(family, version)

    def forget_pull(self, family: str, version: str) -> None:
        self.index.forget_pull(family, version)

    def recent_pulls(self, family: str, n: int) -> list[str]:
        return self.index.recent_pulls(family, n)

    def record_orphans(self) -> int:
        return self.index.record_orphans()

    # -- eviction's --------------------------------------------------------------------------------

    def pin(self, family: str) -> None:
        self.eviction.pin(family)

    def unpin(self, family: str) -> None:
        self.eviction.unpin(family)

    def pinned(self) -> list[str]:
        return self.eviction.pinned()

    # -- the leases' -------------------------------------------------------------------------------

    def leased(self, keys: Iterable[str]) -> AbstractContextManager[Lease]:
        return self.leases.leased(keys)

    def leased_bytes(self) -> int:
        return self.leases.leased_bytes()

    def leased_keys(self) -> set[str]:
        return self.leases.leased_keys()

    def total_bytes(self) -> int:
        return self.eviction.total_bytes()

    def evict(self, max_bytes: int | None = None, protect: Iterable[str] = ()) -> tuple[int, int]:
        return self.eviction.evict(max_bytes, protect)

    # -- chunks -----------------------------------------------------------------------------------

    def has(self, chunk_id: str) -> bool:
        """Whether a plain file stands at the chunk's name (a directory, a link or a fifo there is no
        cached chunk: it is fetched, and written over it)."""
        return is_plain(self.chunk_file(chunk_id))

    def get(self, chunk_id: str) -> bytes | None:
        got = read_plain(self.chunk_file(chunk_id))
        return got[0] if got is not None else None

    def get_verified(self, chunk_id: str, mapped: bool = False) -> bytes | memoryview | None:
        """A cached chunk's bytes if they hash to its id; a damaged or cut-short file is dropped (and
        None returned) so that it is fetched again. For bases of deltas: a bad basis would otherwise
        make every decode against it fail, pull after pull, blamed on the registry's packs.
        ``mapped``: a read-only view of the file mapped (cachefiles.map_plain), not a copy."""
        path = self.chunk_file(chunk_id)
        got = map_plain(path) if mapped else read_plain(path)
        if got is None:
            return None
        data, seen = got
        if chunk_id_of(data) != chunk_id:
            self.discard(chunk_id, seen)
            return None
        return data

    def read_into(self, chunk_id: str, out) -> bool:
        """Read a chunk straight into a writable buffer (a tensor's bytes); False if not cached, or
        if its file is not exactly that long (a load that skips the id check relies on this), or is
        not a plain file at all."""
        opened = open_plain(self.chunk_file(chunk_id))
        if opened is None:
            return False
        fd, st = opened
        try:
            if st.st_size != len(out):
                return False
            return os.preadv(fd, [out], 0) == len(out)
        finally:
            os.close(fd)

    def put(self, chunk_id: str, raw: bytes, tier: str | None = None, family: str | None = None) -> None:
        """Store verified raw bytes (the caller checked them against the id)."""
        self.put_many([(chunk_id, raw, tier, family)])

    def put_many(
        self, items: Iterable[tuple[str, bytes, str | None, str | None]], replace: bool | AbstractSet[str] = False
    ) -> None:
        """Store many verified chunks: each file written atomically, then one index transaction.
        ``replace``: write over a file already there (one found missing, cut short or damaged, and
        fetched again): renamed over it, so a reader sees the old file or the new, and a good copy
        another process wrote meanwhile is only replaced by the same bytes. True for every item, or
        the set of ids to write over (the others are written only where no file stands)."""
        with self.placing() as place:
            for chunk_id, raw, tier, family in items:
                place(chunk_id, raw, tier, family, replace if isinstance(replace, bool) else chunk_id in replace)

    @contextmanager
    def placing(self) -> Iterator[Callable[[str, bytes | memoryview, str | None, str | None, bool], None]]:
        """put_many's two halves for chunks that come one by one, from any thread (a fetch writes
        each as it is decoded): ``place(id, raw, tier, family, replace)`` writes a verified chunk's
        file where none stands (or over it, with ``replace``), and the rows of every chunk placed are
        recorded in one transaction at the end of the block. Where the block fails (a full disk, an
        interrupt), the files already placed stay and are recorded too, or they would go uncounted
        by stats and the size limit; an error of that record is not raised over the first (record
        leaves the marker from which a later pass counts them)."""
        rows: list[tuple[str, int, str | None, str | None]] = []

        def place(
            chunk_id: str, raw: bytes | memoryview, tier: str | None, family: str | None, replace: bool = False
        ) -> None:
            path = self.chunk_file(chunk_id)
            if replace or not is_plain(path):  # a directory there fails the rename, in one line
                self._write_chunk(chunk_id, path, raw)
            rows.append((chunk_id, len(raw), tier, family))

        try:
            yield place
        except BaseException:
            if rows:
                try:
                    self.record(rows)
                except Exception:  # noqa: BLE001  (the first error is the one to report)
                    pass
            raise
        self.record(rows)

    def _write_chunk(self, chunk_id: str, path: str, raw: bytes | memoryview) -> None:
        # read-only: CPU tensors map these files (registry/client/mapping.py), so an edit in
        # place would change live weights under a model that was checked once
        try:
            atomic_write(path, raw, mode=0o444)
        except NotADirectoryError:
            # Something that is not a directory stands at the chunk's shard (chunks/ab): no writer
            # makes one, so it is damage, and the shard's chunks are lost anyway. Put the directory
            # back and write again (a chunks/ that is itself a file is make_dir's one line).
            self.clear_shard(chunk_id[:2])
            make_dir(Path(path).parent)
            atomic_write(path, raw, mode=0o444)

    def clear_shard(self, prefix: str) -> bool:
        """Remove what stands at the shard directory chunks/<prefix> if it is not a directory (a
        file, a link, a fifo); whether something went. A shard another process has just put back
        as a directory stays."""
        path = f"{self.layout.chunks}/{prefix}"
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                return False
            os.unlink(path)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):  # gone, or a directory by now
            return False
        except OSError as exc:
            raise StorageError(
                f"cannot remove {path}, which stands where the node cache keeps a directory of chunks: "
                f"{exc.strerror}: remove it by hand, or set MFSREG_CACHE_DIR to a cache of your own"
            ) from None
        return True

    def discard(self, chunk_id: str, seen: os.stat_result | None = None) -> None:
        """Drop one chunk (found damaged or cut short on disk): its rows, then its file. ``seen``:
        the stat of the file found damaged; if another file is there now (another process fetched
        the chunk again meanwhile), that one stays."""
        self._drop(self.chunk_file(chunk_id), chunk_id, seen)

    def _drop(self, path: str, key: str, seen: os.stat_result | None) -> None:
        """Remove the file at ``path`` and the rows of ``key``: those of a chunk (all its tables),
        or a materialised file's entry. Rows and file go together under the write lock, so that a
        process that found the file a moment ago and records it as used cannot make its row again
        between the two (record looks for the file under that lock)."""
        with self.index.db() as db:
            if seen is not None:
                # The file is renamed aside first, and its identity checked there: a check at its
                # name followed by an unlink of that name removed a good copy another process
                # renamed into place between the two. Renamed aside, what is checked is what goes.
                aside = temp_name(path)
                try:
                    os.rename(path, aside)
                except FileNotFoundError:  # gone already (evicted, or dropped by another): its rows go
                    forget_rows(db, [key])
                    return
                now = os.lstat(aside)
                if (now.st_dev, now.st_ino) != (seen.st_dev, seen.st_ino):
                    # a good copy placed since the damaged file was read: back to its name (a copy
                    # placed there since holds the same bytes), and its rows stay
                    os.rename(aside, path)
                    return
                forget_rows(db, [key])
                os.unlink(aside)
                return
            forget_rows(db, [key])
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def failed_again(self, chunk_id: str) -> IntegrityError:
        """The error for a chunk that is missing or damaged even after it was fetched again."""
        if not self.has(chunk_id):  # evicted again meanwhile by another process
            if self.max_bytes is None:
                return IntegrityError(
                    f"chunk {chunk_id} left the node cache again while it was being placed (another "
                    "process's `cache verify` or `cache prune` dropped it): run it again"
                )
            return IntegrityError(f"chunk {chunk_id} keeps leaving the node cache: raise MFSREG_CACHE_MAX")
        return IntegrityError(
            f"chunk {chunk_id} does not match its id even after fetching it again: "
            "check this node's disk and memory, then retry"
        )

    def discard_file(self, sha256: str, seen: os.stat_result | None = None) -> None:
        """Drop one materialised file (found damaged): its row, then the file (links elsewhere keep
        theirs). ``seen``: as for discard."""
        self._drop(str(self.file_path(sha256)), f"file:{sha256}", seen)

    def stats(self) -> dict:
        rows = (
            self.index.conn()
            .execute("SELECT rank, COUNT(*), COALESCE(SUM(size), 0) FROM entries GROUP BY rank")
            .fetchall()
        )
        return _stats(self.root, self.max_bytes, rows, self.pinned())


def missing_cache_stats(root: Path | None = None) -> dict | None:
    """``stats`` of the cache at ``root`` (default: MFSREG_CACHE_DIR's) where no cache is there yet,
    without making one (a command that only reads leaves a mistyped MFSREG_CACHE_DIR as it found
    it); None where the directory exists."""
    root = cache_root(root) if root is not None else default_cache_dir()
    return None if root.exists() else _stats(root, default_max_bytes(), [], [])


def _stats(root: Path, max_bytes: int | None, rows: list[tuple[int, int, int]], pinned: list[str]) -> dict:
    names = {FILE_RANK: "files", **{r: t for t, r in RANK.items()}}
    by = {names[r]: {"entries": n, "bytes": b} for r, n, b in rows}
    return {
        "path": str(root),
        "max_bytes": max_bytes,
        "bytes": sum(b for _, _, b in rows),
        "chunks": sum(n for r, n, _ in rows if r != FILE_RANK),
        "by_tier": by,
        "pinned_families": pinned,
    }
