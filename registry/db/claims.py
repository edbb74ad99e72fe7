"""Queries on chunk claims (models.chunk_claims): which chunks a push uploaded to a family before a
commit used them, and which of a version's chunks the families a token may read already use."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import Connection, delete, func, select

from mfsreg.registry.db.dialect import batches, insert
from mfsreg.registry.db.models import chunk_claims as cc
from mfsreg.registry.db.models import family_chunks as fc


def record(conn: Connection, family: str, ids: Sequence[str]) -> None:
    """Claims for ``ids`` (a claim made again starts its grace period afresh)."""
    for batch in batches(sorted(set(ids))):
        stmt = insert(conn, cc).values([{"family": family, "chunk_id": i} for i in batch])
        conn.execute(
            stmt.on_conflict_do_update(index_elements=[cc.c.family, cc.c.chunk_id], set_={"created_at": func.now()})
        )


def claimed(conn: Connection, family: str, ids: Sequence[str]) -> set[str]:
    found: set[str] = set()
    for batch in batches(list(ids)):
        found.update(
            conn.execute(select(cc.c.chunk_id).where(cc.c.family == family, cc.c.chunk_id.in_(batch))).scalars()
        )
    return found


def forget(conn: Connection, family: str, ids: Sequence[str]) -> None:
    """Drop the claims a commit has used (the family now uses those chunks)."""
    for batch in batches(sorted(set(ids))):  # the order record() locks in: no deadlock between the two
        conn.execute(delete(cc).where(cc.c.family == family, cc.c.chunk_id.in_(batch)))


def forget_before(conn: Connection, cutoff: datetime) -> int:
    """Drop the claims of pushes that never committed, once older than prune's grace period."""
    return conn.execute(delete(cc).where(cc.c.created_at < cutoff)).rowcount or 0


def used_by_families(conn: Connection, family_ids: Sequence[int], ids: Sequence[str]) -> set[str]:
    """The subset of ``ids`` that some family among ``family_ids`` uses."""
    found: set[str] = set()
    if not family_ids:
        return found
    fam_ids = list(family_ids)
    for batch in batches(list(ids)):
        found.update(
            conn.execute(
                select(fc.c.chunk_id).distinct().where(fc.c.family_id.in_(fam_ids), fc.c.chunk_id.in_(batch))
            ).scalars()
        )
    return found
