"""Queries on stored chunks and packs: which ids are missing, recording packs (and what a mend that
re-chains chunks changes in the versions that need them), locating chunks."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence, Set
from typing import Any

from sqlalchemy import Connection, and_, bindparam, delete, select, update

from mfsreg.registry.blobs.packs import StoredChunk
from mfsreg.registry.db import rebalance as tier_db
from mfsreg.registry.db import versions as version_db
from mfsreg.registry.db.dialect import batches, insert
from mfsreg.registry.db.locks import exclude_prune, exclude_writers
from mfsreg.registry.db.models import chunks, families, family_chunks, version_chunks, versions
from mfsreg.registry.db.reclaim import list_pack
from mfsreg.registry.errors import Pruned
from mfsreg.registry.format.manifest import Manifest


def missing_ids(conn: Connection, ids: Sequence[str]) -> set[str]:
    """The subset of ``ids`` that the registry does not store yet."""
    present: set[str] = set()
    for batch in batches(list(ids)):
        present.update(conn.execute(select(chunks.c.id).where(chunks.c.id.in_(batch))).scalars())
    return set(ids) - present


def record_pack(
    conn: Connection, pack_id: str, size: int, stored: Sequence[StoredChunk], mend: Set[str] = frozenset()
) -> int:
    """Record a durable, announced pack and its chunks; returns the stored bytes of the chunks that
    were new, or mended. ``mend``: chunks sent again because their stored copy was lost or damaged;
    their rows move here, and rechain runs where a delta chain changes. A chunk a concurrent push
    recorded first keeps its place. Raises Pruned where a prune deleted a basis of its deltas.
    See docs/design/prune.md.
    """
    # (over 60 lines: one transaction's steps (locks, bases, mends, rows) in the order they must
    # run)
    if mend.isdisjoint(c.id for c in stored):
        exclude_prune(conn)
    else:  # a mend may re-chain chunks, and with them what versions need: see rechain
        exclude_writers(conn)
    bases = {c.basis_id for c in stored if c.basis_id} - {c.id for c in stored}
    gone = missing_ids(conn, list(bases))
    if gone:
        raise Pruned(
            f"the basis chunk {min(gone)} of a delta in this push was deleted by a prune meanwhile: push again"
        )
    list_pack(conn, pack_id, size)
    # Sorted rows: two transactions inserting overlapping ids lock them in the same order (no deadlock).
    rows: list[dict[str, Any]] = sorted(
        (
            dict(
                id=c.id,
                size=c.size,
                encoding=c.encoding,
                stored_size=c.stored_size,
                pack_id=c.pack_id,
                offset=c.offset,
                basis_id=c.basis_id,
                depth=c.depth,
            )
            for c in stored
        ),
        key=lambda r: r["id"],
    )
    if not rows:
        return 0
    # RETURNING names the rows this transaction really inserted, not those a concurrent push won.
    # Passed as a list of parameter sets, SQLAlchemy compiles the statement once and sends the rows
    # in multi-row batches ("insertmanyvalues"), where insert().values(rows) compiles afresh for
    # every batch (about 0.1 ms a row).
    result = conn.execute(
        insert(conn, chunks).on_conflict_do_nothing().returning(chunks.c.id, chunks.c.stored_size), rows
    )
    added = {i: n for i, n in result}
    again = [r for r in rows if r["id"] in mend and r["id"] not in added]
    if again:
        before = locate(conn, [r["id"] for r in again])
        stmt = (
            update(chunks)
            .where(chunks.c.id == bindparam("cid"))
            .values(
                encoding=bindparam("encoding"),
                stored_size=bindparam("stored_size"),
                pack_id=pack_id,
                offset=bindparam("offset"),
                basis_id=bindparam("basis_id"),
                depth=bindparam("depth"),
            )
        )
        conn.execute(stmt, [dict(r, cid=r["id"]) for r in again])
        rechain(conn, [r["id"] for r in again if before[r["id"]].basis_id != r["basis_id"]])
    return sum(added.values()) + sum(r["stored_size"] for r in again)


def repoint_plain(conn: Connection, pack_id: str, size: int, stored: Sequence[StoredChunk]) -> None:
    """A durable pack of plain copies of stored chunks (registry/store/access.py), and those chunks' rows
    pointed at it: no longer deltas. Their old copies are dead weight until prune repacks them. A
    chunk deleted meanwhile (a prune) stays deleted: the commit that needed it finds it missing.
    The versions that used the deltas no longer need their bases: rechain, as a mend does."""
    exclude_writers(conn)  # chains change, as in a mend (rechain)
    list_pack(conn, pack_id, size)
    before = locate(conn, [c.id for c in stored])
    stmt = (
        update(chunks)
        .where(chunks.c.id == bindparam("cid"))
        .values(
            encoding=bindparam("enc"),
            stored_size=bindparam("n"),
            pack_id=pack_id,
            offset=bindparam("off"),
            basis_id=None,
            depth=0,
        )
    )
    conn.execute(
        stmt,
        [dict(cid=c.id, enc=c.encoding, n=c.stored_size, off=c.offset) for c in sorted(stored, key=lambda c: c.id)],
    )
    rechain(conn, sorted(i for i, c in before.items() if c.basis_id is not None))


def rechain(conn: Connection, ids: Sequence[str]) -> int:
    """The chunks ``ids`` were just pointed at copies with other delta chains (record_pack's mend,
    repoint_plain): each version that needs one gets its version_chunks rows made its own chunks
    and their bases down the chains as they are now, and its family's tiers follow
    (db/rebalance.change_uses). Returns how many rows were added and dropped. The caller holds exclude_writers;
    families are locked in name order, as delete and commit lock theirs.
    See docs/design/check.md.
    """
    if not ids:
        return 0
    names: set[str] = set()
    for batch in batches(list(ids)):
        names.update(
            conn.execute(
                select(families.c.name)
                .distinct()
                .select_from(version_chunks)
                .join(versions, versions.c.id == version_chunks.c.version_id)
                .join(families, families.c.id == versions.c.family_id)
                .where(version_chunks.c.chunk_id.in_(batch))
            ).scalars()
        )
    changed = 0
    for name in sorted(names):
        fam = version_db.lock_family(conn, name)
        listed: dict[int, set[str]] = {}
        for vid in _versions_using(conn, fam.id, ids):
            listed[vid] = set(version_db.version_chunk_ids(conn, vid))
        own = {vid: Manifest.from_bytes(version_db.read_manifest(conn, vid)).chunk_ids() for vid in listed}
        located = locate_closure(conn, {i for o in own.values() for i in o})  # once for all: members share most
        uses: Counter[str] = Counter()
        for vid, had in listed.items():
            need = _needed(own[vid], located)
            gained, lost = sorted(need - had), sorted(had - need)
            if lost:
                conn.execute(
                    delete(version_chunks).where(
                        version_chunks.c.version_id == vid, version_chunks.c.chunk_id == bindparam("cid")
                    ),
                    [dict(cid=c) for c in lost],
                )
            if gained:
                conn.execute(version_chunks.insert(), [dict(version_id=vid, chunk_id=c) for c in gained])
            uses.update(dict.fromkeys(gained, 1))
            uses.subtract(dict.fromkeys(lost, 1))
            changed += len(gained) + len(lost)
        if listed:
            tier_db.change_uses(conn, fam.id, uses, fam.member_count, fam.base_quorum)
    return changed


def _versions_using(conn: Connection, family_id: int, ids: Sequence[str]) -> set[int]:
    found: set[int] = set()
    for batch in batches(list(ids)):
        found.update(
            conn.execute(
                select(version_chunks.c.version_id)
                .distinct()
                .join(versions, versions.c.id == version_chunks.c.version_id)
                .where(versions.c.family_id == family_id, version_chunks.c.chunk_id.in_(batch))
            ).scalars()
        )
    return found


def _needed(own: Iterable[str], located: dict[str, StoredChunk]) -> set[str]:
    """``own`` and the bases of their deltas, down the chains in ``located``. A chunk without a row
    stays listed: check names it as unrecorded."""
    need: set[str] = set()
    i: str | None
    for i in own:
        while i is not None and i not in need:
            need.add(i)
            i = located[i].basis_id if i in located else None
    return need


# a chunks row as StoredChunk's fields, in their order
_STORED = (
    chunks.c.id,
    chunks.c.size,
    chunks.c.encoding,
    chunks.c.stored_size,
    chunks.c.pack_id,
    chunks.c.offset,
    chunks.c.basis_id,
    chunks.c.depth,
)


def locate(conn: Connection, ids: Iterable[str]) -> dict[str, StoredChunk]:
    """Where each of ``ids`` is stored. Ids that are not stored are simply absent from the result."""
    out: dict[str, StoredChunk] = {}
    for batch in batches(list(dict.fromkeys(ids))):
        for row in conn.execute(select(*_STORED).where(chunks.c.id.in_(batch))):
            out[row.id] = StoredChunk(*row)
    return out


def locate_in_family(conn: Connection, family: str, ids: Iterable[str]) -> dict[str, StoredChunk]:
    """Where each of ``ids`` that family ``family`` uses (directly or as a delta basis) is stored, in
    one query per batch of ids (a node's download asked three: the family, its use of the ids,
    their places). Ids the family does not use, or that are not stored, are absent."""
    out: dict[str, StoredChunk] = {}
    for batch in batches(list(dict.fromkeys(ids))):
        q = (
            select(*_STORED)
            .select_from(chunks)
            .join(family_chunks, family_chunks.c.chunk_id == chunks.c.id)
            .join(families, families.c.id == family_chunks.c.family_id)
            .where(families.c.name == family, chunks.c.id.in_(batch))
        )
        for row in conn.execute(q):
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
    needs (its version_chunks rows: its own chunks and the bases of their deltas), in one join with
    the family given as a constant: what a node reads before a pull or a load.
    See docs/design/protocol.md."""
    family_id = conn.execute(select(versions.c.family_id).where(versions.c.id == version_id)).scalar()
    q = (
        select(
            chunks.c.id, chunks.c.encoding, chunks.c.stored_size, chunks.c.basis_id, chunks.c.size, family_chunks.c.tier
        )
        .select_from(version_chunks)
        .join(chunks, chunks.c.id == version_chunks.c.chunk_id)
        .outerjoin(
            family_chunks,
            and_(family_chunks.c.family_id == family_id, family_chunks.c.chunk_id == version_chunks.c.chunk_id),
        )
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
        select(
            chunks.c.id, chunks.c.encoding, chunks.c.stored_size, chunks.c.basis_id, chunks.c.size, family_chunks.c.tier
        )
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
