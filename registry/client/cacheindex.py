"""The node cache's index of its entries: a row per chunk and materialised file (size, rank, family,
last use), each family's word on a chunk's tier, recent pulls, and the marker and scan that record
files standing without rows. Rows are made only for files that stand at their names while the write
lock is held (see record).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterable

from mfsreg.registry.client.cachefiles import holds_any, is_plain, is_temp
from mfsreg.registry.client.eviction import FILE_RANK, RANK, UNKNOWN_RANK
from mfsreg.registry.client.indexdb import SCHEMA, WriteTx, forget_rows, index_error, rows_in, use_wal
from mfsreg.registry.client.layout import CacheLayout
from mfsreg.registry.errors import StorageError

UNRECORDED = "unrecorded"  # the marker of files that may lack rows (see the module docstring)


class CacheIndex:
    """A node cache's rows, in ``layout.index``; the layout (layout.CacheLayout) gives the paths of
    entries and the listing of files on disk that the scan walks. ``conn`` and ``db`` are its
    interface to the other parts (eviction's queries and writes share the index's lock).

    Index rows are bookkeeping: every file is written and renamed on its own, so a lost or damaged
    index loses no chunk."""

    def __init__(self, layout: CacheLayout):
        self.layout = layout
        self.path = layout.index
        self._open_index()

    def _open_index(self) -> None:
        """Open index.db (made if missing), bring it to the current version, and record files that
        stand without rows where the marker says some may."""
        self._local = threading.local()
        self._conns: list[sqlite3.Connection] = []  # every thread's, for close() to close them all
        self._conns_lock = threading.Lock()
        try:
            self.conn().executescript(SCHEMA)  # idempotent; executescript manages its own transaction
        except sqlite3.DatabaseError as exc:  # not a database (damaged), or no room to write it
            raise index_error(self.path, exc) from None
        with self.db() as db:
            if db.execute("PRAGMA user_version").fetchone()[0] < 1:
                if db.execute("SELECT 1 FROM entries LIMIT 1").fetchone() is None:
                    # A new index (or an empty one from before family_base): where chunks/ or files/
                    # already hold entries, the index was deleted (damaged) or lost, and those files
                    # have no rows, so stats and the size limit would leave them out. The marker is
                    # left before the version is written: an opener killed before the walk below
                    # leaves it for the next one. (An empty cache costs two directory reads.)
                    if holds_any(self.layout.chunks) or holds_any(self.layout.files):
                        self._mark_unrecorded()
                else:
                    # a cache from before family_base: what its rows knew (one family per chunk)
                    db.execute(
                        "INSERT OR IGNORE INTO family_base (family, key) SELECT family, key FROM entries "
                        "WHERE rank = ? AND family IS NOT NULL",
                        (RANK["base"],),
                    )
                db.execute("PRAGMA user_version = 1")
        self._record_unrecorded()

    def conn(self) -> sqlite3.Connection:
        """This thread's connection to the index (one per thread, made on first use)."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            # used by this thread alone; another may only close it (close())
            conn = sqlite3.connect(self.path, timeout=60, isolation_level=None, check_same_thread=False)
            with self._conns_lock:
                self._conns.append(conn)
            use_wal(conn, self.path)
            # The index is bookkeeping (sizes, tiers, last use) beside files that are written and
            # renamed on their own: with NORMAL a crash may lose the last few updates but never
            # corrupts the database, and a load no longer waits for an fsync per touch.
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA busy_timeout=60000")
            self._local.conn = conn
        return conn

    def db(self) -> WriteTx:
        """A write transaction on the index (the write lock held until it ends)."""
        return WriteTx(self.conn(), self.path)

    def _mark_unrecorded(self) -> None:
        """Leave the marker that files may stand without rows: a write of rows for files already on
        disk failed. Best effort: an empty file needs no data block, so it is made on most full
        disks; where it is not, `cache prune` and `cache verify` still record those files."""
        try:
            os.close(
                os.open(self.layout.root / UNRECORDED, os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            )
        except OSError:
            pass

    def _record_unrecorded(self) -> None:
        """Where the marker stands, record the files that have no row (one walk of the cache), so that
        stats and the size limit count them again. The marker goes first: a writer that fails while
        the walk runs marks again. Where the rows still cannot be written (the disk still full), the
        marker is put back for the next opening, and the cache opens all the same."""
        try:
            os.unlink(self.layout.root / UNRECORDED)
        except OSError:  # none (the common case), another opener took it, or not ours to remove
            return
        try:
            self.record_orphans()
        except StorageError:
            self._mark_unrecorded()

    def close(self) -> None:
        """Close every thread's connection now, the pool threads' that a pull or load used included:
        left to the garbage collector, they held their files open, and the last one to close wrote
        the log back into index.db whenever that happened."""
        with self._conns_lock:
            conns, self._conns = self._conns, []
            self._local = threading.local()
        for conn in conns:
            conn.close()

    # -- rows of chunks ---------------------------------------------------------------------------

    def record(self, items: Iterable[tuple[str, int, str | None, str | None]]) -> None:
        """Rows for entries on disk (key, size, tier, family), used now; a file without one gets
        one. A chunk's rank is the highest its families give it, each as it told last. A row is made
        only for a file that stands at its name while the write lock is held (eviction removes files
        under it too). Raises StorageError, leaving the ``unrecorded`` marker, where the index
        cannot be written.
        See docs/design/node-cache.md."""
        now = time.time()
        items = list(items)
        if not items:  # no write transaction (a fetch's first request waited on it)
            return
        rows = [(k, n, RANK.get(t, UNKNOWN_RANK) if t else UNKNOWN_RANK, fam, now) for k, n, t, fam in items]
        try:
            with self.db() as db:
                # the rows there are updated in place; a load of cached chunks (every key has its row)
                # stops here, with no stat of its files and no query more than before
                updated = db.executemany(
                    "UPDATE entries SET rank = MAX(rank, ?), last_used = ?, family = COALESCE(family, ?) WHERE key = ?",
                    [(r, t, fam, k) for k, _, r, fam, t in rows],
                ).rowcount
                if rows and updated != len(rows):
                    known = {
                        r[0]
                        for r in rows_in(
                            db, "SELECT key FROM entries WHERE key IN ({})", list(dict.fromkeys(k for k, *_ in rows))
                        )
                    }
                    gone = {k for k, *_ in rows if k not in known and not is_plain(self.layout.chunk_file(k))}
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
        with self.db() as db:
            db.executemany("UPDATE entries SET last_used = ? WHERE key = ?", [(now, i) for i in chunk_ids])

    def set_tiers(self, tiers: dict[str, str | None], family: str | None = None) -> None:
        """What the registry says now of these chunks' tiers (in ``family``): tiers move as members
        join. Without a family, the ranks are set as told."""
        # A chunk the registry names without a tier (a delta's basis that no listed member uses
        # itself) keeps the rank the cache holds: taken for unique, a pinned base chunk fell to the
        # bottom of the eviction order once unpinned.
        ranks = [(i, RANK.get(t, UNKNOWN_RANK)) for i, t in tiers.items() if t]
        with self.db() as db:
            if family is None:
                db.executemany("UPDATE entries SET rank = ? WHERE key = ?", [(r, i) for i, r in ranks])
                return
            _rerank(db, [(family, i, r) for i, r in ranks], only_cached=True)
            _note_base(db, [(i, t, family) for i, t in tiers.items()])

    def forget_missing(self, prefix: str) -> int:
        """Drop the index rows of chunks named chunks/<prefix>/... whose files are not there (the
        shard was lost): the size limit would count them until an eviction. Returns how many."""
        # looked for under the write lock: a chunk another process places and records meanwhile
        # keeps its row (record makes rows under the same lock)
        with self.db() as db:
            keys = [r[0] for r in db.execute("SELECT key FROM entries WHERE substr(key, 1, 2) = ?", (prefix,))]
            gone = [k for k in keys if not os.path.lexists(self.layout.chunk_file(k))]
            forget_rows(db, gone)
        return len(gone)

    def forget(self, chunk_ids: list[str]) -> None:
        """Drop chunks' rows, and leave their files alone."""
        with self.db() as db:
            forget_rows(db, chunk_ids)

    # -- files ------------------------------------------------------------------------------------

    def add_file(self, sha256: str, size: int) -> None:
        """A materialised file's row, used now (made if its writer died before it): one statement,
        so that no eviction ever sees it ranked as anything but a file. As for chunks (record), a
        row is made only while the file stands: an eviction may have taken it since it was used."""
        try:
            with self.db() as db:
                key = f"file:{sha256}"
                if db.execute("SELECT 1 FROM entries WHERE key = ?", (key,)).fetchone() is None and not is_plain(
                    str(self.layout.file_path(sha256))
                ):
                    return
                db.execute(
                    "INSERT INTO entries (key, size, rank, family, last_used) VALUES (?, ?, ?, NULL, ?) "
                    "ON CONFLICT(key) DO UPDATE SET size = excluded.size, rank = excluded.rank, "
                    "last_used = excluded.last_used",
                    (key, size, FILE_RANK, time.time()),
                )
        except StorageError:
            self._mark_unrecorded()  # as record does: the file is there, its row is not
            raise

    # -- recent pulls -----------------------------------------------------------------------------

    def record_pull(self, family: str, version: str) -> None:
        with self.db() as db:
            db.execute(
                "INSERT INTO pulls (family, version, last_used) VALUES (?, ?, ?) "
                "ON CONFLICT(family, version) DO UPDATE SET last_used = excluded.last_used",
                (family, version, time.time()),
            )

    def forget_pull(self, family: str, version: str) -> None:
        with self.db() as db:
            db.execute("DELETE FROM pulls WHERE family = ? AND version = ?", (family, version))

    def recent_pulls(self, family: str, n: int) -> list[str]:
        q = "SELECT version FROM pulls WHERE family = ? ORDER BY last_used DESC LIMIT ?"
        return [r[0] for r in self.conn().execute(q, (family, n))]

    # -- files without rows -----------------------------------------------------------------------

    def record_orphans(self) -> int:
        """Rows for the chunk and materialised files that have none (their writer was killed between
        renaming the file into place and recording it): counted against the size limit and evicted
        like any other entry from now on. Returns how many."""
        found = {
            (f"file:{e.name}" if kind == "file" else e.name): e
            for kind, e in self.layout.disk_files()
            if not is_temp(e.name)
        }
        keys = list(found)
        known = {r[0] for r in rows_in(self.conn(), "SELECT key FROM entries WHERE key IN ({})", keys)}
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


def _rerank(db: sqlite3.Connection, told: list[tuple[str, str, int]], only_cached: bool = False) -> None:
    """Record what each family told of each chunk's rank (family, key, rank), and set the entries
    whose word changed to the highest rank any family gives them. Loads tell the same ranks again
    and again: only the changes are written (one read of the current word first). ``only_cached``:
    ignore chunks without an entry (a warm tells the ranks of a whole tier)."""
    if not told:
        return
    keys = list(dict.fromkeys(k for _, k, _ in told))
    now = {(f, k): r for f, k, r in rows_in(db, "SELECT family, key, rank FROM family_rank WHERE key IN ({})", keys)}
    changed = [(f, k, r) for f, k, r in told if now.get((f, k)) != r]
    if not changed:
        return
    if only_cached:
        cached = {r[0] for r in rows_in(db, "SELECT key FROM entries WHERE key IN ({})", keys)}
        changed = [(f, k, r) for f, k, r in changed if k in cached]
    db.executemany(
        "INSERT INTO family_rank (family, key, rank) VALUES (?, ?, ?) "
        "ON CONFLICT(family, key) DO UPDATE SET rank = excluded.rank",
        changed,
    )
    db.executemany(
        "UPDATE entries SET rank = (SELECT MAX(rank) FROM family_rank WHERE family_rank.key = entries.key) "
        "WHERE key = ?",
        [(k,) for k in dict.fromkeys(k for _, k, _ in changed)],
    )


def _note_base(db: sqlite3.Connection, items: list[tuple[str, str | None, str | None]]) -> None:
    """Keep family_base in step with (key, tier, family) as the registry last told them: a chunk
    enters its family's base tier, or leaves it (a member that drifted moved it to group)."""
    told = [(fam, k, t) for k, t, fam in items if fam is not None and t is not None]
    db.executemany(
        "INSERT OR IGNORE INTO family_base (family, key) VALUES (?, ?)", [(fam, k) for fam, k, t in told if t == "base"]
    )
    db.executemany(
        "DELETE FROM family_base WHERE family = ? AND key = ?", [(fam, k) for fam, k, t in told if t != "base"]
    )
