"""The little that differs between SQLite and Postgres: upserts and batch sizes."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from sqlalchemy import Connection, Table

# Bound parameters per IN list: far below SQLite's and Postgres' limits, large enough that a
# thousand-chunk push costs a handful of round trips.
BATCH = 900


def insert(conn: Connection, table: Table):
    """An INSERT that supports on_conflict_do_nothing / on_conflict_do_update on both engines.
    The dialect's module loads here, on first use: Postgres' alone takes 40 ms to import."""
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects import postgresql

        return postgresql.insert(table)
    from sqlalchemy.dialects import sqlite

    return sqlite.insert(table)


def batches(items: Sequence, size: int = BATCH) -> Iterator[Sequence]:
    for i in range(0, len(items), size):
        yield items[i : i + size]
