"""Queries on stored chunks and packs: which ids are missing, recording packs, locating chunks."""

from __future__ import annotations

from collections.abc import Iterable, Sequence, Set

from sqlalchemy import Connection, and_, bindparam, select, update

from registry.blobs.packs import StoredChunk
from registry.db.dialect import batches, insert
from registry.db.locks import exclude_prune
from registry.db.models import chunks, family_chunks, version_chunks, versions
from registry.db.prune import list_pack
from registry.errors import Pruned


def missing_ids(conn: Connection, ids: Sequence[str]) -> set[str]:
    """The subset of ``ids`` that the registry does not store yet."""
    present: set[str] = set()
    for batch in batches(list(ids)):
        present.update(conn.execute(select(chunks.c.id).where(chunks.c.id.in_(batch))).scalars())
    return set(ids) - present


def record_pack(conn: Connection, pack_id: str, size: int, stored: Sequence[StoredChunk],
                mend: Set[str] = frozenset()) -> int:
    """Record a durable pack (announced before it was written: db/prune.announce_pack) and its
    chunks; returns the stored bytes of the chunks that were new, or mended.

    ``mend`` names chunks sent again because the pack their row points into was lost from the blob
    store (registry/lost.py): where such a row is found, it is pointed at this copy instead.

    A chunk that a concurrent push recorded first keeps its first location (ON CONFLICT DO
    NOTHING); the copy in this pack is dead weight until prune repacks it (registry/prune.py).
    Refused (Pruned) when a prune deleted the basis of one of its deltas after the push chose it:
    recorded, the delta could never be decoded, and a re-run would take it for stored.
    """
    exclude_prune(conn)
    bases = {c.basis_id for c in stored if c.basis_id} - {c.id for c in stored}
    gone = missing_ids(conn, list(bases))
    if gone:
        raise Pruned(f"the basis chunk {min(gone)} of a delta in this push was deleted by a prune meanwhile: push again")
    list_pack(conn, pack_id, size)
    # Sorted rows: two transactions inserting overlapping ids lock them in the same order (no deadlock).
    rows = sorted(
        (dict(id=c.id, size=c.size, encoding=c.encoding, stored_size=c.stored_size,
              pack_id=c.pack_id, offset=c.offset, basis_id=c.basis_id, depth=c.depth) for c in stored),
        key=lambda r: r["id"],
    )
    if not rows:
        return 0
    # RETURNING names the rows this transaction really inserted, not those a concurrent push won.
    # Passed as a list of parameter sets, SQLAlchemy compiles the statement once and sends the rows
    # in multi-row batches ("insertmanyvalues"); an insert().values(rows) was compiled afresh for
    # every batch, at about 0.1 ms a row.
    result = conn.execute(insert(conn, chunks).on_conflict_do_nothing().returning(chunks.c.id, chunks.c.stored_size), rows)
    added = {i: n for i, n in result}
    again = [r for r in rows if r["id"] in mend and r["id"] not in added]
    if again:
        stmt = (
            update(chunks).where(chunks.c.id == bindparam("cid"))
            .values(encoding=bindparam("encoding"), stored_size=bindparam("stored_size"), pack_id=pack_id,
                    offset=bindparam("offset"), basis_id=bindparam("basis_id"), depth=bindparam("depth"))
        )
        conn.execute(stmt, [dict(r, cid=r["id"]) for r in again])
    return sum(added.values()) + sum(r["stored_size"] for r in again)


def repoint_plain(conn: Connection, pack_id: str, size: int, stored: Sequence[StoredChunk]) -> None:
    """A durable pack of plain copies of stored chunks (registry/access.py), and those chunks' rows
    pointed at it: no longer deltas. Their old copies are dead weight until prune repacks them. A
    chunk deleted meanwhile (a prune) stays deleted: the commit that needed it finds it missing."""
    exclude_prune(conn)
    list_pack(conn, pack_id, size)
    stmt = (
        update(chunks).where(chunks.c.id == bindparam("cid"))
        .values(encoding=bindparam("enc"), stored_size=bindparam("n"), pack_id=pack_id, offset=bindparam("off"),
                basis_id=None, depth=0)
    )
    conn.execute(stmt, [dict(cid=c.id, enc=c.encoding, n=c.stored_size, off=c.offset)
                        for c in sorted(stored, key=lambda c: c.id)])


def locate(conn: Connection, ids: Iterable[str]) -> dict[str, StoredChunk]:
    """Where each of ``ids`` is stored. Ids that are not stored are simply absent from the result."""
    out: dict[str, StoredChunk] = {}
    cols = (chunks.c.id, chunks.c.size, chunks.c.encoding, chunks.c.stored_size,
            chunks.c.pack_id, chunks.c.offset, chunks.c.basis_id, chunks.c.depth)
    for batch in batches(list(dict.fromkeys(ids))):
        for row in conn.execute(select(*cols).where(chunks.c.id.in_(batch))):
            out[row.id] = StoredChunk(*row)
    return out


def locate_closure(conn: Connection, ids: Iterable[str]) -> dict[str, StoredChunk]:
    """Where ``ids`` and, transitively, the basis chunks of their deltas are stored."""
    out = locate(conn, ids)
    todo = {c.basis_id for c in out.values() if c.basis_id and c.basis_id not in out}
    while todo:
        found = locate(conn, todo)
        out.update(found)
        todo = {c.basis_id for c in found.values() if c.basis_id and c.basis_id not in out}
    return out


def version_chunk_table(conn: Connection, version_id: int) -> dict[str, list]:
    """chunk id -> [encoding, stored bytes, basis id, raw bytes, tier] for every chunk a version
    needs, in one join: what a node reads before a pull or a load. A commit records the version's
    chunks and the bases of their deltas (ingest.commit_version), so this is the same closure as
    ``locate_closure`` of its manifest; locating a thousand ids through IN lists, and building full
    rows for them, took most of that request. The family is looked up first and given as a
    constant: joined through versions.family_id, which the planner cannot know in advance, Postgres
    hashed the whole family_chunks table (every family's) and scanned all chunks, so the document
    took time in the size of the registry, not of the version (224 ms against 89 at 1.75M rows)."""
    family_id = conn.execute(select(versions.c.family_id).where(versions.c.id == version_id)).scalar()
    q = (
        select(chunks.c.id, chunks.c.encoding, chunks.c.stored_size, chunks.c.basis_id, chunks.c.size, family_chunks.c.tier)
        .select_from(version_chunks)
        .join(chunks, chunks.c.id == version_chunks.c.chunk_id)
        .outerjoin(family_chunks, and_(family_chunks.c.family_id == family_id,
                                       family_chunks.c.chunk_id == version_chunks.c.chunk_id))
        .where(version_chunks.c.version_id == version_id)
    )
    return {row[0]: list(row[1:]) for row in conn.execute(q).all()}  # one fetchall, not a fetch per row


def family_chunk_table(conn: Connection, family_id: int, tier: str | None = None) -> dict[str, list]:
    """chunk id -> [encoding, stored bytes, basis id, raw bytes, tier] for a family's chunks (of one
    tier, or all), in one join, and the bases their deltas decode against (tier None where they
    are not of that tier: a node warming the unique tier needs them, cached or not): what a node
    reads to warm its cache. Looked up through IN lists, a family of 105k chunks took 118 round
    trips (1.6 s) where the join takes 0.35 s. All tiers hold every basis already (a commit
    records the bases of a version's deltas among its chunks)."""
    q = (
        select(chunks.c.id, chunks.c.encoding, chunks.c.stored_size, chunks.c.basis_id, chunks.c.size, family_chunks.c.tier)
        .select_from(family_chunks)
        .join(chunks, chunks.c.id == family_chunks.c.chunk_id)
        .where(family_chunks.c.family_id == family_id)
    )
    if tier is not None:
        q = q.where(family_chunks.c.tier == tier)
    table = {row[0]: list(row[1:]) for row in conn.execute(q).all()}
    bases = {row[2] for row in table.values() if row[2] is not None and row[2] not in table}
    for c in locate_closure(conn, bases).values():
        table.setdefault(c.id, [c.encoding, c.stored_size, c.basis_id, c.size, None])
    return table
