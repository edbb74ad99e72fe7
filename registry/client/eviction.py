"""The node cache's eviction policy: the rank each entry is evicted by (materialised files, then
unique, group and base chunks), pins that keep a family's base tier, and the size limit, enforced
least recently used first within each rank.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from registry.client.indexdb import forget_rows
from registry.tiers import EVICTION_ORDER

# Lower ranks go first. Materialised files can be rebuilt from chunks, so they go before any chunk.
FILE_RANK = -1
RANK = {tier: i for i, tier in enumerate(EVICTION_ORDER)}  # unique 0, group 1, base 2
UNKNOWN_RANK = RANK["unique"]


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
            forget_rows(db, victims)
        if failed is not None:
            raise failed
        return removed, freed
