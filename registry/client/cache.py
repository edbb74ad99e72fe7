"""The node cache: verified raw chunks on local disk, content-addressed and size-bounded.

Layout under MFSREG_CACHE_DIR (default $XDG_CACHE_HOME/mfsreg where that is absolute, else ~/.cache/mfsreg):
  chunks/ab/<id>     raw chunk bytes (decoded and checked against the id before they are written),
                     read-only
  files/<sha256>     whole files materialised for engines (`pull --to-dir` hardlinks them)
  index.db           SQLite (stdlib, WAL): size, tier, pin and last use per entry
  unrecorded         present while files may stand without index rows (a write to the index
                     failed, say on a full disk, or a new index.db was made beside cached files):
                     the next opening records them, then removes it

Several processes on one node share it safely: each write goes to a unique temp name and is renamed
into place (the same id always holds the same bytes, so a lost race costs nothing), and the index
is a WAL database that serialises its writers. Eviction drops materialised files first, then
unique, group and base chunks, least recently used first within each, and never a chunk of a
pinned family's base tier or one the current operation still needs.
"""

from __future__ import annotations

import errno
import os
import re
import sqlite3
import stat
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Set as AbstractSet
from pathlib import Path

from registry.chunking import chunk_id as chunk_id_of
from registry.durable import NO_ROOM, what_to_do
from registry.errors import IntegrityError, InvalidRequest, StorageError
from registry.tiers import EVICTION_ORDER

# Lower ranks go first. Materialised files can be rebuilt from chunks, so they go before any chunk.
FILE_RANK = -1
RANK = {tier: i for i, tier in enumerate(EVICTION_ORDER)}  # unique 0, group 1, base 2
UNKNOWN_RANK = RANK["unique"]
STALE_TEMP_SECONDS = 3600  # temp files older than this were left by a writer that died
UNRECORDED = "unrecorded"  # the marker of files that may lack rows (see the module docstring)


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
        raise InvalidRequest(f"{name}='' is empty: give an absolute path, e.g. /var/cache/mfsreg"
                             + ("" if name == "MFSREG_CACHE_DIR" else ", or leave it out to use MFSREG_CACHE_DIR"))
    from registry.config import expand_user

    path = expand_user(name, text)
    if not path.is_absolute():
        raise InvalidRequest(f"{name}={text!r} is not an absolute path: give one, e.g. /var/cache/mfsreg")
    _no_padding(text, name)
    return path


def _no_padding(text: str, name: str, hint: str = "") -> Path:
    if text != text.strip():
        raise InvalidRequest(f"{name}={text!r} starts or ends with a space, which no directory is meant to: "
                             f"remove it{hint}")
    return Path(text)


def default_max_bytes() -> int | None:
    from registry.config import size_from_env

    return size_from_env("MFSREG_CACHE_MAX", None)


_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    key TEXT PRIMARY KEY,      -- chunk id, or 'file:<sha256>'
    size INTEGER NOT NULL,
    rank INTEGER NOT NULL,
    family TEXT,
    last_used REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS entries_evict ON entries (rank, last_used);
CREATE TABLE IF NOT EXISTS pins (family TEXT PRIMARY KEY);
-- which cached chunks are in which family's base tier: a chunk two families share is protected by
-- a pin of either (entries.family names only the first family that cached it)
CREATE TABLE IF NOT EXISTS family_base (family TEXT, key TEXT, PRIMARY KEY (family, key));
CREATE INDEX IF NOT EXISTS family_base_key ON family_base (key);
-- each family's word on a cached chunk's tier (as a rank): entries.rank is the highest of them, so a
-- chunk one family holds as base and another as unique is evicted as base, and a tier that moves
-- down in a family lowers it
CREATE TABLE IF NOT EXISTS family_rank (family TEXT, key TEXT, rank INTEGER NOT NULL, PRIMARY KEY (family, key));
CREATE INDEX IF NOT EXISTS family_rank_key ON family_rank (key);
CREATE TABLE IF NOT EXISTS pulls (family TEXT, version TEXT, last_used REAL, PRIMARY KEY (family, version));
"""


class NodeCache:
    def __init__(self, root: Path | None = None, max_bytes: int | None = None):
        self.root = cache_root(root) if root is not None else default_cache_dir()
        self.max_bytes = max_bytes if max_bytes is not None else default_max_bytes()
        _make_dir(self.root / "chunks")
        self._chunks = str(self.root / "chunks")
        self._index = self.root / "index.db"
        _make_dir(self.root / "files")
        self._local = threading.local()
        try:
            self._conn().executescript(_SCHEMA)  # idempotent; executescript manages its own transaction
        except sqlite3.DatabaseError as exc:  # not a database (damaged), or no room to write it
            raise index_error(self._index, exc) from None
        with self._db() as db:
            if db.execute("PRAGMA user_version").fetchone()[0] < 1:
                if db.execute("SELECT 1 FROM entries LIMIT 1").fetchone() is None:
                    # A new index (or an empty one from before family_base): where chunks/ or files/
                    # already hold entries, the index was deleted (damaged) or lost, and those files
                    # have no rows, so stats and the size limit would leave them out. The marker is
                    # left before the version is written: an opener killed before the walk below
                    # leaves it for the next one. (An empty cache costs two directory reads.)
                    if _holds_any(self._chunks) or _holds_any(self.root / "files"):
                        self._mark_unrecorded()
                else:
                    # a cache from before family_base: what its rows knew (one family per chunk)
                    db.execute("INSERT OR IGNORE INTO family_base (family, key) SELECT family, key FROM entries "
                               "WHERE rank = ? AND family IS NOT NULL", (RANK["base"],))
                db.execute("PRAGMA user_version = 1")
        self._record_unrecorded()

    # -- index ------------------------------------------------------------------------------------

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self._index, timeout=60, isolation_level=None)
            _use_wal(conn, self._index)
            # The index is bookkeeping (sizes, tiers, last use) beside files that are written and
            # renamed on their own: with NORMAL a crash may lose the last few updates but never
            # corrupts the database, and a load no longer waits for an fsync per touch.
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA busy_timeout=60000")
            self._local.conn = conn
        return conn

    def _db(self):
        return _Tx(self._conn(), self._index)

    def _mark_unrecorded(self) -> None:
        """Leave the marker that files may stand without rows: a write of rows for files already on
        disk failed. Best effort: an empty file needs no data block, so it is made on most full
        disks; where it is not, `cache prune` and `cache verify` still record those files."""
        try:
            os.close(os.open(self.root / UNRECORDED, os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644))
        except OSError:
            pass

    def _record_unrecorded(self) -> None:
        """Where the marker stands, record the files that have no row (one walk of the cache), so that
        stats and the size limit count them again. The marker goes first: a writer that fails while
        the walk runs marks again. Where the rows still cannot be written (the disk still full), the
        marker is put back for the next opening, and the cache opens all the same."""
        try:
            os.unlink(self.root / UNRECORDED)
        except OSError:  # none (the common case), another opener took it, or not ours to remove
            return
        try:
            self.record_orphans()
        except StorageError:
            self._mark_unrecorded()

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    # -- chunks -----------------------------------------------------------------------------------

    def chunk_path(self, chunk_id: str) -> Path:
        return Path(self.chunk_file(chunk_id))

    def chunk_file(self, chunk_id: str) -> str:
        """The chunk's file as a plain string: loads look up a thousand chunks or more, and pathlib's
        joins cost more than the stat itself."""
        return f"{self._chunks}/{chunk_id[:2]}/{chunk_id}"

    def file_path(self, sha256: str) -> Path:
        return self.root / "files" / sha256

    def has(self, chunk_id: str) -> bool:
        """Whether a plain file stands at the chunk's name (a directory, a link or a fifo there is no
        cached chunk: it is fetched, and written over it)."""
        return _plain(self.chunk_file(chunk_id))

    def get(self, chunk_id: str) -> bytes | None:
        got = _read_plain(self.chunk_file(chunk_id))
        return got[0] if got is not None else None

    def get_verified(self, chunk_id: str) -> bytes | None:
        """A cached chunk's bytes if they hash to its id; a damaged or cut-short file is dropped (and
        None returned) so that it is fetched again. For bases of deltas: a bad basis would otherwise
        make every decode against it fail, pull after pull, blamed on the registry's packs."""
        got = _read_plain(self.chunk_file(chunk_id))
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

    def put_many(self, items: Iterable[tuple[str, bytes, str | None, str | None]],
                 replace: bool | AbstractSet[str] = False) -> None:
        """Store many verified chunks: each file written atomically, then one index transaction.
        ``replace``: write over a file already there (one found missing, cut short or damaged, and
        fetched again): renamed over it, so a reader sees the old file or the new, and a good copy
        another process wrote meanwhile is only replaced by the same bytes. True for every item, or
        the set of ids to write over (the others are written only where no file stands)."""
        rows = []
        try:
            for chunk_id, raw, tier, family in items:
                path = self.chunk_file(chunk_id)
                over = replace if isinstance(replace, bool) else chunk_id in replace
                if over or not _plain(path):  # a directory there fails the rename, in one line
                    self._write_chunk(chunk_id, path, raw)
                rows.append((chunk_id, len(raw), tier, family))
        except BaseException:
            # the files renamed into place before the one that failed (a full disk, an interrupt)
            # stay: recorded, or they would go uncounted by stats and the size limit
            if rows:
                try:
                    self.record(rows)
                except Exception:  # noqa: BLE001  (record left the marker; the first error is the one to report)
                    pass
            raise
        self.record(rows)

    def _write_chunk(self, chunk_id: str, path: str, raw: bytes) -> None:
        # read-only: CPU tensors map these files (registry/client/mapping.py), so an edit in
        # place would change live weights under a model that was checked once
        try:
            atomic_write(path, raw, mode=0o444)
        except NotADirectoryError:
            # Something that is not a directory stands at the chunk's shard (chunks/ab): no writer
            # makes one, so it is damage, and the shard's chunks are lost anyway. Put the directory
            # back and write again (a chunks/ that is itself a file is _make_dir's one line).
            self.clear_shard(chunk_id[:2])
            _make_dir(Path(path).parent)
            atomic_write(path, raw, mode=0o444)

    def clear_shard(self, prefix: str) -> bool:
        """Remove what stands at the shard directory chunks/<prefix> if it is not a directory (a
        file, a link, a fifo); whether something went. A shard another process has just put back
        as a directory stays."""
        path = f"{self._chunks}/{prefix}"
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                return False
            os.unlink(path)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):  # gone, or a directory by now
            return False
        except OSError as exc:
            raise StorageError(f"cannot remove {path}, which stands where the node cache keeps a directory of chunks: "
                               f"{exc.strerror}: remove it by hand, or set MFSREG_CACHE_DIR to a cache of your own") from None
        return True

    def forget_missing(self, prefix: str) -> int:
        """Drop the index rows of chunks named chunks/<prefix>/... whose files are not there (the
        shard was lost): the size limit would count them until an eviction. Returns how many."""
        # looked for under the write lock: a chunk another process places and records meanwhile
        # keeps its row (record makes rows under the same lock)
        with self._db() as db:
            keys = [r[0] for r in db.execute("SELECT key FROM entries WHERE substr(key, 1, 2) = ?", (prefix,))]
            gone = [k for k in keys if not os.path.lexists(self.chunk_file(k))]
            _forget(db, gone)
        return len(gone)

    def forget(self, chunk_ids: list[str]) -> None:
        """Drop chunks' rows, and leave their files alone."""
        with self._db() as db:
            _forget(db, chunk_ids)

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
        with self._db() as db:
            if seen is not None:
                # The file is renamed aside first, and its identity checked there: a check at its
                # name followed by an unlink of that name removed a good copy another process
                # renamed into place between the two. Renamed aside, what is checked is what goes.
                aside = _temp_name(path)
                try:
                    os.rename(path, aside)
                except FileNotFoundError:  # gone already (evicted, or dropped by another): its rows go
                    _forget(db, [key])
                    return
                now = os.lstat(aside)
                if (now.st_dev, now.st_ino) != (seen.st_dev, seen.st_ino):
                    # a good copy placed since the damaged file was read: back to its name (a copy
                    # placed there since holds the same bytes), and its rows stay
                    os.rename(aside, path)
                    return
                _forget(db, [key])
                os.unlink(aside)
                return
            _forget(db, [key])
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def failed_again(self, chunk_id: str) -> IntegrityError:
        """The error for a chunk that is missing or damaged even after it was fetched again."""
        if not self.has(chunk_id):  # evicted again meanwhile by another process
            if self.max_bytes is None:
                return IntegrityError(f"chunk {chunk_id} left the node cache again while it was being placed (another "
                                      "process's `cache verify` or `cache prune` dropped it): run it again")
            return IntegrityError(f"chunk {chunk_id} keeps leaving the node cache: raise MFSREG_CACHE_MAX")
        return IntegrityError(f"chunk {chunk_id} does not match its id even after fetching it again: "
                              "check this node's disk and memory, then retry")

    def discard_file(self, sha256: str, seen: os.stat_result | None = None) -> None:
        """Drop one materialised file (found damaged): its row, then the file (links elsewhere keep
        theirs). ``seen``: as for discard."""
        self._drop(str(self.file_path(sha256)), f"file:{sha256}", seen)

    def record(self, items: Iterable[tuple[str, int, str | None, str | None]]) -> None:
        """Rows for entries on disk (key, size, tier, family), used now; a file without one (its
        writer died before recording it) gets one. A chunk's rank is the highest its families give
        it, each as it told last (an entry no family has told keeps the highest it was given).

        A row is made only for a file that stands at its name while the write lock is held:
        eviction and discard remove files under that lock too, so a caller that found a chunk
        cached before another process evicted it never makes a row for the file that went (which
        stats and the size limit would count until an eviction picked that row)."""
        now = time.time()
        items = list(items)
        rows = [(k, n, RANK.get(t, UNKNOWN_RANK) if t else UNKNOWN_RANK, fam, now) for k, n, t, fam in items]
        try:
            with self._db() as db:
                # the rows there are updated in place; a load of cached chunks (every key has its row)
                # stops here, with no stat of its files and no query more than before
                updated = db.executemany(
                    "UPDATE entries SET rank = MAX(rank, ?), last_used = ?, family = COALESCE(family, ?) WHERE key = ?",
                    [(r, t, fam, k) for k, _, r, fam, t in rows],
                ).rowcount
                if rows and updated != len(rows):
                    known = {r[0] for r in _rows_in(db, "SELECT key FROM entries WHERE key IN ({})",
                                                    list(dict.fromkeys(k for k, *_ in rows)))}
                    gone = {k for k, *_ in rows if k not in known and not _plain(self.chunk_file(k))}
                    if gone:
                        rows = [r for r in rows if r[0] not in gone]
                        items = [i for i in items if i[0] not in gone]
                    db.executemany(
                        "INSERT INTO entries (key, size, rank, family, last_used) VALUES (?, ?, ?, ?, ?) "
                        "ON CONFLICT(key) DO UPDATE SET rank = MAX(rank, excluded.rank), last_used = excluded.last_used, "
                        "family = COALESCE(entries.family, excluded.family)",  # (a key given twice)
                        [r for r in rows if r[0] not in known],
                    )
                _rerank(db, [(fam, k, r) for k, _, r, fam, _ in rows if fam is not None])
                _note_base(db, [(k, t, fam) for k, _, t, fam in items])
        except StorageError:
            # the files are on disk and the index does not know them (a full disk stopped the
            # write): stats and the size limit would leave them out until a prune found them
            self._mark_unrecorded()
            raise

    def touch(self, chunk_ids: Iterable[str]) -> None:
        now = time.time()
        with self._db() as db:
            db.executemany("UPDATE entries SET last_used = ? WHERE key = ?", [(now, i) for i in chunk_ids])

    def set_tiers(self, tiers: dict[str, str | None], family: str | None = None) -> None:
        """What the registry says now of these chunks' tiers (in ``family``): tiers move as members
        join. Without a family, the ranks are set as told."""
        # A chunk the registry names without a tier (a delta's basis that no listed member uses
        # itself) keeps the rank the cache holds: taken for unique, a pinned base chunk fell to the
        # bottom of the eviction order once unpinned.
        ranks = [(i, RANK.get(t, UNKNOWN_RANK)) for i, t in tiers.items() if t]
        with self._db() as db:
            if family is None:
                db.executemany("UPDATE entries SET rank = ? WHERE key = ?", [(r, i) for i, r in ranks])
                return
            _rerank(db, [(family, i, r) for i, r in ranks], only_cached=True)
            _note_base(db, [(i, t, family) for i, t in tiers.items()])

    # -- files ------------------------------------------------------------------------------------

    def add_file(self, sha256: str, size: int) -> None:
        """A materialised file's row, used now (made if its writer died before it): one statement,
        so that no eviction ever sees it ranked as anything but a file. As for chunks (record), a
        row is made only while the file stands: an eviction may have taken it since it was used."""
        try:
            with self._db() as db:
                key = f"file:{sha256}"
                if (db.execute("SELECT 1 FROM entries WHERE key = ?", (key,)).fetchone() is None
                        and not _plain(str(self.file_path(sha256)))):
                    return
                db.execute("INSERT INTO entries (key, size, rank, family, last_used) VALUES (?, ?, ?, NULL, ?) "
                           "ON CONFLICT(key) DO UPDATE SET size = excluded.size, rank = excluded.rank, "
                           "last_used = excluded.last_used", (key, size, FILE_RANK, time.time()))
        except StorageError:
            self._mark_unrecorded()  # as record does: the file is there, its row is not
            raise

    # -- pins, recent pulls -------------------------------------------------------------------------

    def pin(self, family: str) -> None:
        with self._db() as db:
            db.execute("INSERT OR IGNORE INTO pins (family) VALUES (?)", (family,))

    def unpin(self, family: str) -> None:
        with self._db() as db:
            db.execute("DELETE FROM pins WHERE family = ?", (family,))

    def pinned(self) -> list[str]:
        return [r[0] for r in self._conn().execute("SELECT family FROM pins ORDER BY family")]

    def record_pull(self, family: str, version: str) -> None:
        with self._db() as db:
            db.execute("INSERT INTO pulls (family, version, last_used) VALUES (?, ?, ?) "
                       "ON CONFLICT(family, version) DO UPDATE SET last_used = excluded.last_used", (family, version, time.time()))

    def forget_pull(self, family: str, version: str) -> None:
        with self._db() as db:
            db.execute("DELETE FROM pulls WHERE family = ? AND version = ?", (family, version))

    def recent_pulls(self, family: str, n: int) -> list[str]:
        q = "SELECT version FROM pulls WHERE family = ? ORDER BY last_used DESC LIMIT ?"
        return [r[0] for r in self._conn().execute(q, (family, n))]

    # -- size limit -------------------------------------------------------------------------------

    def total_bytes(self) -> int:
        return self._conn().execute("SELECT COALESCE(SUM(size), 0) FROM entries").fetchone()[0]

    def evict(self, max_bytes: int | None = None, protect: Iterable[str] = ()) -> tuple[int, int]:
        """Drop entries until the cache fits ``max_bytes`` (default: its limit); returns (entries, bytes)."""
        limit = self.max_bytes if max_bytes is None else max_bytes
        if limit is None:
            return 0, 0
        if self.total_bytes() <= limit:  # the common case, without taking the write lock
            return 0, 0
        keep = set(protect)
        removed = freed = 0
        victims = []
        q = ("SELECT key, size FROM entries WHERE NOT EXISTS (SELECT 1 FROM family_base b JOIN pins p "
             "ON p.family = b.family WHERE b.key = entries.key) ORDER BY rank, last_used")
        # The total, the choice and the deletion in one write transaction: two pulls finishing
        # together would otherwise each count the other's chunks as still there and both evict,
        # emptying the cache far below its limit. The files go inside it too: a process that found
        # a victim cached and records it as used waits for the lock, then finds no file and makes
        # no row (committed first and deleted after, its row came back for a file about to go, and
        # stats counted bytes that were not there). A reader that finds no file fetches it again.
        failed = None
        with self._db() as db:
            total = db.execute("SELECT COALESCE(SUM(size), 0) FROM entries").fetchone()[0]
            if total <= limit:
                return 0, 0
            for key, size in db.execute(q).fetchall():
                if total <= limit:
                    break
                if key in keep:
                    continue
                path = str(self.file_path(key[5:])) if key.startswith("file:") else self.chunk_file(key)
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                except OSError as exc:  # the rows of the files that went still go; this one's stays
                    failed = exc
                    break
                victims.append(key)
                total -= size
                removed += 1
                freed += size
            _forget(db, victims)
        if failed is not None:
            raise failed
        return removed, freed

    def disk_files(self) -> Iterator[tuple[str, os.DirEntry]]:
        """Every plain file on disk, temp files included: ("chunk", entry) for those under chunks/
        (one level of subdirectories), ("file", entry) for materialised files."""
        return ((kind, e) for kind, e in self._disk_entries() if e.is_file(follow_symlinks=False))

    def disk_others(self) -> Iterator[tuple[str, os.DirEntry]]:
        """What stands at a chunk's or a materialised file's place and is not a plain file (a
        directory, a link, a fifo): no writer makes these, and each would stop that file being
        written (a rename onto a directory fails) while a listing of plain files passes it over."""
        for kind, e in self._disk_entries():
            named = _CHUNK_NAME if kind == "chunk" else _FILE_NAME
            if named.fullmatch(e.name) and not e.is_file(follow_symlinks=False):
                yield kind, e

    def shard_blockers(self) -> Iterator[os.DirEntry]:
        """What stands at a shard directory's name in chunks/ (two hex digits) and is not a
        directory: a file, a link, a fifo. No writer makes these; listings pass them over, and
        each stops every chunk of its shard being written."""
        for e in os.scandir(self._chunks):
            if _SHARD_NAME.fullmatch(e.name) and not e.is_dir(follow_symlinks=False):
                yield e

    def _disk_entries(self) -> Iterator[tuple[str, os.DirEntry]]:
        """Every entry in chunks/' subdirectories ("chunk") and in files/ ("file")."""
        for kind, top, nested in (("chunk", self._chunks, True), ("file", str(self.root / "files"), False)):
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

    def record_orphans(self) -> int:
        """Rows for the chunk and materialised files that have none (their writer was killed between
        renaming the file into place and recording it): counted against the size limit and evicted
        like any other entry from now on. Returns how many."""
        found = {(f"file:{e.name}" if kind == "file" else e.name): e
                 for kind, e in self.disk_files() if not is_temp(e.name)}
        keys = list(found)
        known = {r[0] for r in _rows_in(self._conn(), "SELECT key FROM entries WHERE key IN ({})", keys)}
        chunks, files = [], []
        for key in keys:
            if key in known:
                continue
            try:
                size = found[key].stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                continue  # evicted or discarded meanwhile
            if key.startswith("file:"):
                files.append((key[5:], size))
            else:
                chunks.append((key, size, None, None))
        if chunks:  # (no write lock taken where there is nothing to record: a scrub of a whole cache)
            self.record(chunks)  # one transaction for them all
        for sha256, size in files:
            self.add_file(sha256, size)
        return len(chunks) + len(files)

    def stats(self) -> dict:
        rows = self._conn().execute("SELECT rank, COUNT(*), COALESCE(SUM(size), 0) FROM entries GROUP BY rank").fetchall()
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
        "path": str(root), "max_bytes": max_bytes, "bytes": sum(b for _, _, b in rows),
        "chunks": sum(n for r, n, _ in rows if r != FILE_RANK), "by_tier": by, "pinned_families": pinned,
    }


def _forget(db: sqlite3.Connection, keys: list[str]) -> None:
    """Delete every row of ``keys``, inside the caller's transaction."""
    for table in ("entries", "family_base", "family_rank"):
        db.executemany(f"DELETE FROM {table} WHERE key = ?", [(k,) for k in keys])


def _rows_in(db: sqlite3.Connection, query: str, keys: list[str]) -> Iterator[tuple]:
    """Rows of ``query`` (its ``{}`` the placeholders of an IN list) over ``keys``, in batches that
    stay under SQLite's limit on bound parameters."""
    for i in range(0, len(keys), 900):
        part = keys[i : i + 900]
        yield from db.execute(query.format(",".join("?" * len(part))), part)


def _rerank(db: sqlite3.Connection, told: list[tuple[str, str, int]], only_cached: bool = False) -> None:
    """Record what each family told of each chunk's rank (family, key, rank), and set the entries
    whose word changed to the highest rank any family gives them. Loads tell the same ranks again
    and again: only the changes are written (one read of the current word first). ``only_cached``:
    ignore chunks without an entry (a warm tells the ranks of a whole tier)."""
    if not told:
        return
    keys = list(dict.fromkeys(k for _, k, _ in told))
    now = {(f, k): r for f, k, r in _rows_in(db, "SELECT family, key, rank FROM family_rank WHERE key IN ({})", keys)}
    changed = [(f, k, r) for f, k, r in told if now.get((f, k)) != r]
    if not changed:
        return
    if only_cached:
        cached = {r[0] for r in _rows_in(db, "SELECT key FROM entries WHERE key IN ({})", keys)}
        changed = [(f, k, r) for f, k, r in changed if k in cached]
    db.executemany("INSERT INTO family_rank (family, key, rank) VALUES (?, ?, ?) "
                   "ON CONFLICT(family, key) DO UPDATE SET rank = excluded.rank", changed)
    db.executemany("UPDATE entries SET rank = (SELECT MAX(rank) FROM family_rank WHERE family_rank.key = entries.key) "
                   "WHERE key = ?", [(k,) for k in dict.fromkeys(k for _, k, _ in changed)])


def _note_base(db: sqlite3.Connection, items: list[tuple[str, str | None, str | None]]) -> None:
    """Keep family_base in step with (key, tier, family) as the registry last told them: a chunk
    enters its family's base tier, or leaves it (a member that drifted moved it to group)."""
    told = [(fam, k, t) for k, t, fam in items if fam is not None and t is not None]
    db.executemany("INSERT OR IGNORE INTO family_base (family, key) VALUES (?, ?)",
                   [(fam, k) for fam, k, t in told if t == "base"])
    db.executemany("DELETE FROM family_base WHERE family = ? AND key = ?",
                   [(fam, k) for fam, k, t in told if t != "base"])


# Opened without blocking: a fifo at a chunk's name made the open wait for a writer forever (and a
# load or pull hang); without following a link (no writer makes one: it is damage, written over).
CACHE_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def open_plain(path: str) -> tuple[int, os.stat_result] | None:
    """A descriptor of the plain file at ``path`` (a cache file), open for reading, and its stat;
    None where nothing is there, or something that is not a plain file (a directory, a link, a fifo,
    a socket or a device), or a file this user may not read but may replace: what a cache's readers
    take for a missing or damaged entry, fetched again and written over. A file this user may
    neither read nor replace is a one-line StorageError."""
    try:
        fd = os.open(path, CACHE_READ_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EMLINK):  # a link (EMLINK on BSD); a socket
            return None
        if exc.errno in (errno.EACCES, errno.EPERM) and may_replace(path):
            # cache files are written 0444, so one without read permission was changed after (a
            # chmod by hand, a restore that lost modes): damage a rename over it repairs
            return None
        raise unreadable(path, exc) from None
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return None
    return fd, st


def may_replace(path: str) -> bool:
    """Whether this user may rename a file over ``path`` (and unlink it): its directory writable."""
    return os.access(os.path.dirname(path), os.W_OK | os.X_OK)


def unreadable(path: str, exc: OSError) -> StorageError:
    """The one line for a cache file this user may neither read nor replace (a shared cache another
    user owns)."""
    return StorageError(f"cannot read {path} in the node cache: {exc.strerror}: check its permissions, or set "
                        "MFSREG_CACHE_DIR to a cache of your own")


def _read_plain(path: str) -> tuple[bytes, os.stat_result] | None:
    """The bytes of the plain file at ``path`` and its stat (see open_plain)."""
    opened = open_plain(path)
    if opened is None:
        return None
    fd, st = opened
    with open(fd, "rb", buffering=0) as f:  # closes fd
        return f.readall(), st


def _holds_any(path: str | os.PathLike) -> bool:
    """Whether the directory at ``path`` has any entry at all (one read of it)."""
    try:
        with os.scandir(path) as it:
            return next(it, None) is not None
    except (FileNotFoundError, NotADirectoryError):
        return False


def _plain(path: str) -> bool:
    """Whether a plain file stands at ``path`` (not following a link): one lstat."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False


def _make_dir(path: Path) -> None:
    """A directory of the cache, made if missing; what stands in its way is one line."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # exist_ok covers a directory there only
        blocker = next((p for p in (path, *path.parents) if os.path.lexists(p) and not p.is_dir()), path)
        raise InvalidRequest(f"the node cache cannot use {path} ({blocker} is a file): a file is where a directory is "
                             "needed; move it away, or set MFSREG_CACHE_DIR (or cache_dir=) to a directory") from None
    except OSError as exc:
        _no_room(str(path), exc)
        raise StorageError(f"the node cache cannot make {path}: {exc.strerror}: check its permissions, or set "
                           "MFSREG_CACHE_DIR to a cache of your own") from None


def index_error(path: Path, exc: sqlite3.DatabaseError) -> StorageError:
    """The one-line error for an index SQLite cannot use: held by another process, not this user's
    to write, damaged, or on a full disk. Only a damaged one is to be deleted: the chunk files stand
    on their own, so a new index loses nothing but bookkeeping."""
    # SQLite's own result code, not its message (which varies by version); the primary code is its
    # low byte (SQLITE_READONLY_DBMOVED and the like share READONLY's). An error raised by the
    # sqlite3 module itself has no code, and reads as damage or a full disk, below.
    code = (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF
    if code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
        return StorageError(f"the node cache's index {path} is locked: another process has held it for over a minute; "
                            f"wait for it, or find it (fuser {path}); the index is shared, do not delete it")
    if code in (sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_PERM, sqlite3.SQLITE_AUTH):
        return StorageError(f"the node cache's index {path} cannot be opened or written ({exc}): this user may not "
                            "write to that cache; check its permissions, or set MFSREG_CACHE_DIR to a cache of your own")
    return StorageError(f"the node cache's index {path} cannot be used ({exc}): free space if the disk is full; "
                        "if the file is damaged, delete it (the cached chunks stay, and the next opening of the "
                        "cache records them again)")


class _Tx:
    """BEGIN IMMEDIATE ... COMMIT: writers queue for the lock instead of failing halfway. An error
    of SQLite's own inside (a full disk, a damaged file) leaves as index_error."""

    def __init__(self, conn: sqlite3.Connection, path: Path):
        self.conn = conn
        self.path = path

    def __enter__(self) -> sqlite3.Connection:
        try:
            self.conn.execute("BEGIN IMMEDIATE")
        except sqlite3.DatabaseError as exc:
            raise index_error(self.path, exc) from None
        return self.conn

    def __exit__(self, exc_type, exc, tb):
        try:
            self.conn.execute("ROLLBACK" if exc_type else "COMMIT")
        except sqlite3.DatabaseError as end:
            raise index_error(self.path, end) from exc
        if isinstance(exc, sqlite3.DatabaseError):
            raise index_error(self.path, exc) from exc


def _use_wal(conn: sqlite3.Connection, path: Path, wait: float = 60.0) -> None:
    """Put the index in WAL mode (readers never wait for the writer). The mode is stored in the file,
    so only the first opening changes it; but that change needs the database to itself, and SQLite
    answers "database is locked" at once instead of waiting (the busy timeout does not cover it):
    two processes opening a new cache at the same moment raced here. So retry that, briefly. Where
    the filesystem cannot do WAL, SQLite keeps its old mode without an error, and so does the cache."""
    deadline = time.monotonic() + wait
    while True:
        try:
            if conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc):
                conn.close()
                raise
        if time.monotonic() > deadline:
            conn.close()
            raise StorageError(f"the node cache's index {path} stays locked: another process holds it; "
                               "check for a stuck mfsreg process")
        time.sleep(0.005)


def _temp_name(path: str) -> str:
    """A unique hidden temp name beside ``path`` (what is_temp knows, and sweep_temps removes once
    an hour old: one a killed process left)."""
    head, _, name = path.rpartition("/")
    return f"{head}/.{name}.{uuid.uuid4().hex}.tmp"


def is_temp(name: str) -> bool:
    """Whether a file name is one of atomic_write's temp names (hidden, ending in .tmp)."""
    return name.startswith(".") and name.endswith(".tmp")


_SHARD_NAME = re.compile(r"[0-9a-f]{2}")
_CHUNK_NAME = re.compile(r"[0-9a-f]{32}")
_FILE_NAME = re.compile(r"[0-9a-f]{64}")


def atomic_write(path: str, data, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` (a string with "/") under a unique hidden temp name beside it,
    then rename it into place.

    A cold pull writes a thousand or more chunk files a gigabyte: this keeps to five system calls
    a file (open, chmod, write, close, rename), making the directory only when the open finds it
    missing. The temp name is random, not the pid: processes in other pid namespaces (containers)
    may share the cache. The mode is set exactly, whatever the umask, so every user of a shared
    cache can read its files."""
    tmp = _temp_name(path)
    head = tmp.rpartition("/")[0]
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    try:
        try:
            fd = os.open(tmp, flags, 0o600)
        except FileNotFoundError:
            os.makedirs(head, exist_ok=True)
            fd = os.open(tmp, flags, 0o600)
    except OSError as exc:
        _no_room(path, exc)
        raise
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data).cast("B")
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        try:
            os.replace(tmp, path)
        except IsADirectoryError:  # the error would name the temp file, which is gone by then
            raise directory_in_the_way(path) from None
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError):
            _no_room(path, exc)
        raise


def directory_in_the_way(path: str | os.PathLike) -> StorageError:
    """The error for a directory standing where a cache file is to be renamed into place."""
    return StorageError(f"cannot write {path}: a directory stands at that name in the node cache; "
                        "`mfsreg cache verify` removes it")


def _no_room(path: str, exc: OSError) -> None:
    # a pull writes its output too: the error must say it was the cache that had no room (a disk
    # full, read-only or failing), not the output
    if exc.errno in NO_ROOM:
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
        raise StorageError(f"the node cache cannot take {path}: {exc.strerror}: {what_to_do(exc.errno)}"
                           + (", or set MFSREG_CACHE_MAX to a size it has room for" if full else
                              ", or set MFSREG_CACHE_DIR to a cache on another disk")) from None
