"""The node cache's SQLite file (index.db, stdlib sqlite3: the one SQL outside registry/db/, so
that a node needs no SQLAlchemy and no database driver): its schema, WAL mode, write transactions,
the one-line errors for an index SQLite cannot use, and the batched row helpers. What the rows mean
is cacheindex.py's; which go first, eviction.py's.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

from mfsreg.registry.errors import StorageError

SCHEMA = """
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
-- what pulls, loads and switches running now use (eviction.py's leases): another process's eviction
-- passes them over; a holder whose lock file is unlocked (its process ended), or that is older than a
-- day, holds nothing; host and pid are there for whoever reads the rows
CREATE TABLE IF NOT EXISTS holders (holder TEXT PRIMARY KEY, host TEXT NOT NULL, pid INTEGER NOT NULL, since REAL NOT NULL);
CREATE TABLE IF NOT EXISTS leases (holder TEXT, key TEXT, PRIMARY KEY (holder, key));
CREATE INDEX IF NOT EXISTS leases_key ON leases (key);
"""


def forget_rows(db: sqlite3.Connection, keys: list[str]) -> None:
    """Delete every row of ``keys``, inside the caller's transaction."""
    for table in ("entries", "family_base", "family_rank"):
        db.executemany(f"DELETE FROM {table} WHERE key = ?", [(k,) for k in keys])


def rows_in(db: sqlite3.Connection, query: str, keys: list[str]) -> Iterator[tuple]:
    """Rows of ``query`` (its ``{}`` the placeholders of an IN list) over ``keys``, in batches that
    stay under SQLite's limit on bound parameters."""
    for i in range(0, len(keys), 900):
        part = keys[i : i + 900]
        yield from db.execute(query.format(",".join("?" * len(part))), part)


def index_error(path: Path, exc: sqlite3.DatabaseError) -> StorageError:
    """The one-line error for an index SQLite cannot use: held by another process, not this user's
    to write, damaged, or on a full disk. Only a damaged one is to be deleted: the chunk files stand
    on their own, so a new index loses nothing but bookkeeping."""
    # SQLite's own result code, not its message (which varies by version); the primary code is its
    # low byte (SQLITE_READONLY_DBMOVED and the like share READONLY's). An error raised by the
    # sqlite3 module itself has no code, and reads as damage or a full disk, below.
    code = (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF
    if code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
        return StorageError(
            f"the node cache's index {path} is locked: another process has held it for over a minute; "
            f"wait for it, or find it (fuser {path}); the index is shared, do not delete it"
        )
    if code in (sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_PERM, sqlite3.SQLITE_AUTH):
        return StorageError(
            f"the node cache's index {path} cannot be opened or written ({exc}): this user may not "
            "write to that cache; check its permissions, or set MFSREG_CACHE_DIR to a cache of your own"
        )
    return StorageError(
        f"the node cache's index {path} cannot be used ({exc}): free space if the disk is full; "
        "if the file is damaged, delete it (the cached chunks stay, and the next opening of the "
        "cache records them again)"
    )


class WriteTx:
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


def use_wal(conn: sqlite3.Connection, path: Path, wait: float = 60.0) -> None:
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
            raise StorageError(
                f"the node cache's index {path} stays locked: another process holds it; "
                "check for a stuck mfsreg process"
            )
        time.sleep(0.005)
