"""Queries of prune (registry/store/prune.py): which chunks versions need, what each pack holds, moving
chunks to new packs, unlisted packs (blobs awaiting deletion), and the lock that keeps one prune
at a time (db/locks.py keeps prune apart from commits and from recording packs)."""

from __future__ import annotations

import fcntl
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, Engine, bindparam, delete, exists, func, select, update

from mfsreg.registry.db.dialect import batches, insert
from mfsreg.registry.db.locks import lock_file, session_lock
from mfsreg.registry.db.models import chunks, packs, unlisted_packs, version_chunks
from mfsreg.registry.errors import Conflict, Pruned

_RUNNING = 0x6D667302  # Postgres advisory lock key: a prune is running (db/locks.py has the other)


@contextmanager
def one_prune_at_a_time(engine: Engine) -> Iterator[None]:
    """Held for a whole prune; a second one is refused (Conflict) instead of racing the first to
    repack the same packs. Postgres: a session advisory lock on a connection kept open; SQLite: a
    lock file beside the database."""
    busy = Conflict("another prune is running on this registry: wait for it to finish")
    if engine.dialect.name == "postgresql":
        with session_lock(engine, _RUNNING, wait=False) as taken:
            if not taken:
                raise busy
            yield
        return
    with lock_file(f"{engine.url.database}.prune.lock") as fh:
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
    q = select(
        chunks.c.id, chunks.c.pack_id, chunks.c.stored_size, chunks.c.basis_id, used, chunks.c.created_at < cutoff
    )
    return [ChunkState(i, p, int(s), b, bool(u), bool(o)) for i, p, s, b, u, o in conn.execute(q)]


def used_among(conn: Connection, ids: Sequence[str]) -> set[str]:
    """Those of ``ids`` that a stored version needs (itself, or as the basis of one of its deltas)."""
    found: set[str] = set()
    for batch in batches(list(ids)):
        q = select(version_chunks.c.chunk_id).where(version_chunks.c.chunk_id.in_(batch)).distinct()
        found.update(conn.execute(q).scalars())
    return found


def deltas_against(conn: Connection, ids: Sequence[str]) -> list[tuple[str, str]]:
    """(chunk id, basis id) of every chunk row stored as a delta against one of ``ids``."""
    rows: list[tuple[str, str]] = []
    for batch in batches(list(ids)):
        q = select(chunks.c.id, chunks.c.basis_id).where(chunks.c.basis_id.in_(batch))
        rows.extend((i, b) for i, b in conn.execute(q))
    return rows


def pack_sizes(conn: Connection) -> dict[str, int]:
    return {i: int(s) for i, s in conn.execute(select(packs.c.id, packs.c.size))}


def delete_chunks(conn: Connection, ids: Sequence[str]) -> None:
    for batch in batches(list(ids)):
        conn.execute(delete(chunks).where(chunks.c.id.in_(batch)))


def retire_packs(conn: Connection, ids: Sequence[str]) -> list[str]:
    """Move those of ``ids`` that no chunk row points into any more from packs to unlisted_packs
    (a pack still pointed into stays listed); returns those moved."""
    empty = ~exists().where(chunks.c.pack_id == packs.c.id)
    retired: list[str] = []
    for batch in batches(list(ids)):
        q = select(packs.c.id, packs.c.size).where(packs.c.id.in_(batch), empty)
        rows = [dict(id=i, size=s) for i, s in conn.execute(q)]
        if rows:
            conn.execute(insert(conn, unlisted_packs).on_conflict_do_nothing(), rows)
            conn.execute(delete(packs).where(packs.c.id.in_([r["id"] for r in rows])))
            retired.extend(r["id"] for r in rows)
    return retired


def chunks_in(conn: Connection, pack_id: str) -> list[tuple]:
    """(id, size, encoding, stored size, offset, basis id, depth) of every chunk row in a pack."""
    q = (
        select(
            chunks.c.id,
            chunks.c.size,
            chunks.c.encoding,
            chunks.c.stored_size,
            chunks.c.offset,
            chunks.c.basis_id,
            chunks.c.depth,
        )
        .where(chunks.c.pack_id == pack_id)
        .order_by(chunks.c.offset)
    )
    return [tuple(r) for r in conn.execute(q)]


def record_moved(conn: Connection, pack_id: str, size: int, moved: Sequence[tuple[str, str, int]]) -> None:
    """A durable new pack, and its chunks' rows pointed at it: (chunk id, old pack id, offset)."""
    list_pack(conn, pack_id, size)
    stmt = (
        update(chunks)
        .where(chunks.c.id == bindparam("cid"), chunks.c.pack_id == bindparam("old"))
        .values(pack_id=pack_id, offset=bindparam("off"))
    )
    conn.execute(stmt, [dict(cid=c, old=o, off=off) for c, o, off in moved])


def unlisted(conn: Connection, before: datetime | None = None) -> list[tuple[str, int]]:
    """(id, size) of unlisted packs; given ``before``, those due for deletion: unlisted since no
    later than that, or claimed by a prune that did not finish. A pack that is listed again is left
    out: a writer of the previous release, which named packs by their bytes and did not announce
    them, recorded the same bytes under the same name."""
    # NOT EXISTS: a NOT IN subquery past work_mem is scanned again per row on Postgres (stats.storage_totals)
    q = select(unlisted_packs.c.id, unlisted_packs.c.size).where(~exists().where(packs.c.id == unlisted_packs.c.id))
    if before is not None:
        q = q.where((unlisted_packs.c.since <= before) | unlisted_packs.c.claimed_at.is_not(None))
    return [(i, int(s)) for i, s in conn.execute(q)]


def forget_relisted(conn: Connection) -> None:
    """Drop unlisted rows of packs that are listed again (see ``unlisted``): their blobs are in use."""
    conn.execute(delete(unlisted_packs).where(unlisted_packs.c.id.in_(select(packs.c.id))))


def _announced(pack_id: str):
    """The row of a pack its writer announced, unless a prune has claimed it since."""
    return (unlisted_packs.c.id == pack_id) & unlisted_packs.c.claimed_at.is_(None)


def is_announced(conn: Connection, pack_id: str) -> bool:
    return conn.execute(select(unlisted_packs.c.id).where(_announced(pack_id))).first() is not None


def claim_due(conn: Connection, before: datetime) -> list[tuple[str, int]]:
    """Claim for deletion, and return, the packs ``unlisted(conn, before)`` names. A claimed pack
    can no longer be listed (list_pack refuses it)."""
    rows = unlisted(conn, before)
    for batch in batches([i for i, _ in rows]):
        conn.execute(update(unlisted_packs).where(unlisted_packs.c.id.in_(batch)).values(claimed_at=func.now()))
    return rows


def forget_unlisted(conn: Connection, ids: Sequence[str]) -> None:
    for batch in batches(list(ids)):
        conn.execute(delete(unlisted_packs).where(unlisted_packs.c.id.in_(batch)))


def announce_pack(conn: Connection, pack_id: str, size: int) -> None:
    """Before a pack's blob is written: should the writer die before list_pack, prune deletes the
    blob once the grace period has passed, instead of it lying in the store forever."""
    conn.execute(insert(conn, unlisted_packs).values(id=pack_id, size=size))


def withdraw_pack(conn: Connection, pack_id: str) -> None:
    """An announced pack whose blob was never written (its writer deleted what may have landed):
    nothing to wait for. One a prune claimed meanwhile stays, for that prune to finish."""
    conn.execute(delete(unlisted_packs).where(_announced(pack_id)))


def list_pack(conn: Connection, pack_id: str, size: int) -> None:
    """A pack whose blob is durable, from unlisted to packs. Refused if prune deleted the blob in the
    meantime (its writer took longer than the grace period): then no chunk row may point into it."""
    if conn.execute(delete(unlisted_packs).where(_announced(pack_id))).rowcount != 1:
        raise Pruned(
            f"pack {pack_id} was taken for abandoned and deleted by a prune before it was recorded (writing "
            "it took longer than prune's --min-age, or prune ran with --min-age 0): push again"
        )
    conn.execute(insert(conn, packs).values(id=pack_id, size=size))
