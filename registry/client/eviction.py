"""The node cache's eviction policy: the rank each entry is evicted by (materialised files, then
unique, group and base chunks), pins that keep a family's base tier, leases that keep what a pull,
load or switch running in some process uses, and the size limit, enforced least recently used first
within each rank.

Leases: each process protects what it is using from its own evictions (``protect``), but several
processes share one cache, and another's eviction could take a chunk this one had found cached or
had just fetched again before it was copied; a second such loss stopped the pull ("keeps leaving
the node cache"). So a pull holds its chunks in ``leases`` for as long as it runs: another process's
eviction passes them over, leaving the cache above its limit for that long, and whichever finishes
last brings it back under. A process killed mid-pull leaves its rows; they hold nothing once its pid
is gone from this host, or once they are a day old (a pid used again, another host's rows).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import uuid
from collections.abc import Iterable, Iterator

from registry.client.indexdb import forget_rows
from registry.errors import StorageError
from registry.tiers import EVICTION_ORDER

# Lower ranks go first. Materialised files can be rebuilt from chunks, so they go before any chunk.
FILE_RANK = -1
RANK = {tier: i for i, tier in enumerate(EVICTION_ORDER)}  # unique 0, group 1, base 2
UNKNOWN_RANK = RANK["unique"]
LEASE_MAX_SECONDS = 24 * 3600  # past this a lease holds nothing, its holder alive or not (see above)
_HOST = socket.gethostname()


def _alive(pid: int) -> bool:
    """Whether a process with this pid runs on this host (signal 0 checks, and sends nothing)."""
    if os.name == "nt":  # os.kill there ends the process: the age limit alone frees such leases
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process (EPERM): alive
        return True
    return True


class Eviction:
    """NodeCache's pins and size limit. Relies on the index's connection and write transaction
    (``_conn``, ``_db``, from CacheIndex), ``max_bytes`` and the paths of entries (``chunk_file``,
    ``file_path``)."""

    # -- pins -------------------------------------------------------------------------------------

    def pin(self, family: str) -> None:
        with self._db() as db:
            db.execute("INSERT OR IGNORE INTO pins (family) VALUES (?)", (family,))

    def unpin(self, family: str) -> None:
        with self._db() as db:
            db.execute("DELETE FROM pins WHERE family = ?", (family,))

    def pinned(self) -> list[str]:
        return [r[0] for r in self._conn().execute("SELECT family FROM pins ORDER BY family")]

    # -- leases -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def leased(self, keys: Iterable[str]) -> Iterator[None]:
        """Keep ``keys`` (chunk ids, or 'file:<sha256>') from every process's eviction while the block
        runs (see the module docstring). Best effort: where the index cannot be written (a full
        disk), the block runs unleased, as before leases, and another process's eviction may take a
        chunk, which is then fetched again."""
        holder = f"{_HOST}:{os.getpid()}:{uuid.uuid4().hex}"
        try:
            with self._db() as db:
                db.execute("INSERT INTO holders (holder, host, pid, since) VALUES (?, ?, ?, ?)",
                           (holder, _HOST, os.getpid(), time.time()))
                db.executemany("INSERT OR IGNORE INTO leases (holder, key) VALUES (?, ?)",
                               [(holder, k) for k in dict.fromkeys(keys)])
        except StorageError:
            holder = None
        try:
            yield
        finally:
            if holder is not None:
                try:
                    with self._db() as db:
                        _release(db, [holder])
                except StorageError:
                    pass  # its rows hold nothing once this process is gone

    def leased_bytes(self) -> int:
        """The bytes of cached entries some holder leases now (kept over the limit by evictions)."""
        return self._conn().execute("SELECT COALESCE(SUM(size), 0) FROM entries WHERE key IN "
                                    "(SELECT key FROM leases)").fetchone()[0]

    def leased_keys(self) -> set[str]:
        """The keys some holder leases now, its process alive or not."""
        return {r[0] for r in self._conn().execute("SELECT DISTINCT key FROM leases")}

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
             "ON p.family = b.family WHERE b.key = entries.key) "
             "AND NOT EXISTS (SELECT 1 FROM leases l WHERE l.key = entries.key) ORDER BY rank, last_used")
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
            _release(db, _lapsed(db))
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
            forget_rows(db, victims)
        if failed is not None:
            raise failed
        return removed, freed


def _lapsed(db) -> list[str]:
    """Holders whose leases hold nothing: their process is gone from this host, or they are older
    than LEASE_MAX_SECONDS."""
    now = time.time()
    return [h for h, host, pid, since in db.execute("SELECT holder, host, pid, since FROM holders")
            if now - since > LEASE_MAX_SECONDS or (host == _HOST and not _alive(pid))]


def _release(db, holders: list[str]) -> None:
    db.executemany("DELETE FROM leases WHERE holder = ?", [(h,) for h in holders])
    db.executemany("DELETE FROM holders WHERE holder = ?", [(h,) for h in holders])
