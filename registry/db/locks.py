"""The lock that keeps prune's decisions apart from the writes that make chunks needed.

Prune (registry/prune.py) decides in one transaction which chunk rows and packs nothing needs and
deletes them, and claims the unlisted packs whose blobs it deletes. A transaction that relies on
stored chunks or on its own announced pack staying (a commit; recording a pack, whose deltas need
their stored bases) must not interleave with those: it would rely on something deleted under it. On Postgres such transactions take a shared advisory lock and prune's
decision the exclusive one; on SQLite nothing is needed, since writers take turns (BEGIN IMMEDIATE).
"""

from __future__ import annotations

from sqlalchemy import Connection, text

_DECIDING = 0x6D667301  # an arbitrary key, mfsreg's own


def exclude_prune(conn: Connection) -> None:
    """Called first in a transaction that relies on stored chunks: waits while a prune decides, and
    that prune waits for this transaction."""
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock_shared(:k)"), {"k": _DECIDING})


def exclude_writers(conn: Connection) -> None:
    """Prune's side of exclude_prune: no such transaction runs until this one ends."""
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _DECIDING})
