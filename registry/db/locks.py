"""The lock that keeps prune's decisions apart from the writes that make chunks needed, and the
session locks held for a whole operation (one prune at a time, one schema upgrade at a time).

On Postgres a transaction that relies on stored chunks, or on its own announced pack, takes
exclude_prune (shared); prune's check, and a pack record that may change delta chains, take
exclude_writers (exclusive). On SQLite, whose writers take turns, both do nothing.
See docs/design/prune.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import DBAPIError

from mfsreg.registry.db.engine import lost_connection, storage_errors

_DECIDING = 0x6D667301  # an arbitrary key, mfsreg's own


def lock_file(path: str) -> IO[str]:
    """The lock file ``path`` beside an SQLite database, opened for flock (made 0600, as the database)."""
    return os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT, 0o600), "a+")


def exclude_prune(conn: Connection) -> None:
    """Called first in a transaction that relies on stored chunks: waits while a prune checks its
    choice and deletes, and that prune waits for this transaction."""
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock_shared(:k)"), {"k": _DECIDING})


def exclude_writers(conn: Connection) -> None:
    """Prune's side of exclude_prune: no such transaction runs until this one ends."""
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _DECIDING})


@contextmanager
def session_lock(engine: Engine, key: int, wait: bool = True) -> Iterator[bool]:
    """A Postgres session advisory lock on ``key``, held on a connection of its own for the whole
    block; yields whether it was taken (always, with ``wait``; without, False if another session
    holds it). The connection is in autocommit, so that holding the lock never leaves it idle in a
    transaction, which a server's idle_in_transaction_session_timeout would end (and the lock with it)."""
    # The server unreachable, or the connection reset while the lock is asked for, is one line
    # (StorageError), as for any query: it was a 500 (a prune whose Postgres was reset at its start).
    with storage_errors(engine):
        conn = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
    with conn:
        with storage_errors(engine):
            if wait:
                conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": key})
                taken = True
            else:
                taken = conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": key}).scalar_one()
        if not taken:
            yield False
            return
        try:
            yield True
        finally:
            try:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})
            except DBAPIError as exc:
                if not lost_connection(exc):
                    raise
                # the session is gone (its connection reset or closed), and its lock with it
