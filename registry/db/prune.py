"""Queries of prune (registry/prune.py): which chunks versions need, what each pack holds, moving
chunks to new packs, retired packs, and the locks that keep prune apart from commits and from
another prune."""

from __future__ import annotations

import fcntl
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, Engine, bindparam, delete, exists, func, select, text, update

from registry.db.dialect import batches, insert
from registry.db.models import chunks, packs, retired_packs, version_chunks
from registry.errors import Conflict

# Advisory lock keys (Postgres): one for "prune is deciding what is garbage" (commits take it
# shared), one for "a prune is running" (held for the whole run).
_DECIDING = 0x6D667301
_RUNNING = 0x6D667302


def exclude_prune(conn: Connection) -> None:
    """Called first in a transaction that makes stored chunks needed (a commit): it waits while a
    prune decides what is garbage, and that prune waits for it, so prune never deletes a chunk that
    a version committing at that moment uses. SQLite needs nothing: its writers take turns."""
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock_shared(:k)"), {"k": _DECIDING})


def exclude_commits(conn: Connection) -> None:
    """Prune's side of exclude_prune: no commit runs until this transaction ends."""
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _DECIDING})


@contextmanager
def one_prune_at_a_time(engine: Engine) -> Iterator[None]:
    """Held for a whole prune; a second one is refused (Conflict) instead of racing the first to
    repack the same packs. Postgres: a session advisory lock on a connection kept open; SQLite: a
    lock file beside the database."""
    busy = Conflict("another prune is running on this registry: wait for it to finish")
    if engine.dialect.name == "postgresql":
        with engine.connect() as conn:
            if not conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": _RUNNING}).scalar_one():
                raise busy
            try:
                yield
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _RUNNING})
                conn.commit()
        return
    with open(f"{engine.url.database}.prune.lock", "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise busy from None
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def db_now(conn: Connection) -> datetime:
    """The database's clock (the one that stamped created_at), not this host's."""
    return conn.execute(select(func.now())).scalar_one()


@dataclass(frozen=True)
class ChunkState:
    id: str
    pack_id: str
    stored_size: int
    basis_id: str | None
    used: bool  # a version needs it (itself, or as the basis of one of its deltas)
    settled: bool  # recorded before the grace period began


def chunk_states(conn: Connection, cutoff: datetime) -> list[ChunkState]:
    used = exists().where(version_chunks.c.chunk_id == chunks.c.id)
    q = select(chunks.c.id, chunks.c.pack_id, chunks.c.stored_size, chunks.c.basis_id, used, chunks.c.created_at < cutoff)
    return [ChunkState(i, p, int(s), b, bool(u), bool(o)) for i, p, s, b, u, o in conn.execute(q)]


def pack_sizes(conn: Connection) -> dict[str, int]:
    return {i: int(s) for i, s in conn.execute(select(packs.c.id, packs.c.size))}


def delete_chunks(conn: Connection, ids: Sequence[str]) -> None:
    for batch in batches(list(ids)):
        conn.execute(delete(chunks).where(chunks.c.id.in_(batch)))


def retire_packs(conn: Connection, ids: Sequence[str]) -> None:
    """Move packs that no chunk row points at any more from packs to retired_packs."""
    for batch in batches(list(ids)):
        rows = [dict(id=i, size=s) for i, s in conn.execute(select(packs.c.id, packs.c.size).where(packs.c.id.in_(batch)))]
        if rows:
            conn.execute(insert(conn, retired_packs).on_conflict_do_nothing(), rows)
        conn.execute(delete(packs).where(packs.c.id.in_(batch)))


def chunks_in(conn: Connection, pack_id: str) -> list[tuple]:
    """(id, size, encoding, stored size, offset, basis id, depth) of every chunk row in a pack."""
    q = select(chunks.c.id, chunks.c.size, chunks.c.encoding, chunks.c.stored_size, chunks.c.offset,
               chunks.c.basis_id, chunks.c.depth).where(chunks.c.pack_id == pack_id).order_by(chunks.c.offset)
    return [tuple(r) for r in conn.execute(q)]


def record_moved(conn: Connection, pack_id: str, size: int, moved: Sequence[tuple[str, str, int]]) -> None:
    """A durable new pack, and its chunks' rows pointed at it: (chunk id, old pack id, offset)."""
    conn.execute(insert(conn, packs).values(id=pack_id, size=size).on_conflict_do_nothing())
    stmt = (
        update(chunks)
        .where(chunks.c.id == bindparam("cid"), chunks.c.pack_id == bindparam("old"))
        .values(pack_id=pack_id, offset=bindparam("off"))
    )
    conn.execute(stmt, [dict(cid=c, old=o, off=off) for c, o, off in moved])


def still_pointing(conn: Connection, pack_id: str) -> int:
    return conn.execute(select(func.count()).select_from(chunks).where(chunks.c.pack_id == pack_id)).scalar_one()


def retired(conn: Connection, before: datetime | None = None) -> list[tuple[str, int]]:
    """(id, size) of retired packs, those retired no later than ``before`` when given."""
    q = select(retired_packs.c.id, retired_packs.c.size)
    if before is not None:
        q = q.where(retired_packs.c.retired_at <= before)
    return [(i, int(s)) for i, s in conn.execute(q)]


def forget_retired(conn: Connection, ids: Sequence[str]) -> None:
    for batch in batches(list(ids)):
        conn.execute(delete(retired_packs).where(retired_packs.c.id.in_(batch)))
