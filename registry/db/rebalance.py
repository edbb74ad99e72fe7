"""SQL for incremental tier rebalancing (policy in registry/store/tiers.py).

Each function works inside the caller's write transaction, after the family row has been locked,
and returns how many rows changed tier so that callers (and tests) can see the work done.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sqlalchemy import Connection, and_, bindparam, case, delete, func, select, update

from mfsreg.registry.db.dialect import batches, insert
from mfsreg.registry.db.models import families
from mfsreg.registry.db.models import family_chunks as fc
from mfsreg.registry.store.tiers import BASE, GROUP, UNIQUE, threshold


def _tier_expr(members: int, base_quorum: float):
    return case(
        (fc.c.users >= threshold(members, base_quorum), BASE),
        (fc.c.users >= 2, GROUP),
        else_=UNIQUE,
    )


def _retier(conn: Connection, family_id: int, chunk_ids: Sequence[str], members: int, quorum: float) -> int:
    """Set the tier of ``chunk_ids`` from their users; returns rows whose tier changed."""
    tier = _tier_expr(members, quorum)
    changed = 0
    for batch in batches(list(chunk_ids)):
        changed += conn.execute(
            update(fc).where(fc.c.family_id == family_id, fc.c.chunk_id.in_(batch), fc.c.tier != tier).values(tier=tier)
        ).rowcount
    return changed


def bump_epoch(conn: Connection, family_id: int) -> None:
    """Mark a change to the family's members or tiers: version documents read before are out of
    date (their tag names the old epoch; service.version_doc)."""
    conn.execute(update(families).where(families.c.id == family_id).values(epoch=families.c.epoch + 1))


def add_member(conn: Connection, family_id: int, chunk_ids: Sequence[str], members_before: int, quorum: float) -> int:
    """A new member that uses ``chunk_ids`` (distinct) joins; returns rows that changed tier."""
    bump_epoch(conn, family_id)
    members = members_before + 1
    if chunk_ids:
        stmt = insert(conn, fc)
        stmt = stmt.on_conflict_do_update(
            index_elements=[fc.c.family_id, fc.c.chunk_id], set_={"users": fc.c.users + 1}
        )
        conn.execute(stmt, [dict(family_id=family_id, chunk_id=c, users=1, tier=UNIQUE) for c in chunk_ids])
    changed = _retier(conn, family_id, chunk_ids, members, quorum)
    # The threshold rose from t0 to t1: chunks the new member does not use, with users in [t0, t1),
    # leave base. (The new member's own chunks were re-tiered above with the new count.)
    t0, t1 = threshold(members_before, quorum), threshold(members, quorum)
    if t1 > t0:
        changed += conn.execute(
            update(fc)
            .where(fc.c.family_id == family_id, fc.c.users >= t0, fc.c.users < t1, fc.c.tier == BASE)
            .values(tier=case((fc.c.users >= 2, GROUP), else_=UNIQUE))
        ).rowcount
    return changed


def remove_member(
    conn: Connection, family_id: int, chunk_ids: Sequence[str], members_before: int, quorum: float
) -> tuple[int, list[str]]:
    """A member that used ``chunk_ids`` leaves; returns (rows that changed tier, ids no member uses now)."""
    bump_epoch(conn, family_id)  # also for the children it leaves: they now descend from its parent
    members = members_before - 1
    ids = list(chunk_ids)
    for batch in batches(ids):
        conn.execute(
            update(fc).where(fc.c.family_id == family_id, fc.c.chunk_id.in_(batch)).values(users=fc.c.users - 1)
        )
    dropped = _drop_unused(conn, family_id, ids)
    changed = _retier(conn, family_id, ids, members, quorum)
    t0, t1 = threshold(members_before, quorum), threshold(members, quorum)
    if members > 0 and t1 < t0:
        changed += conn.execute(
            update(fc)
            .where(fc.c.family_id == family_id, fc.c.users >= t1, fc.c.users < t0, fc.c.tier != BASE)
            .values(tier=BASE)
        ).rowcount
    return changed, dropped


def change_uses(
    conn: Connection, family_id: int, uses: Mapping[str, int], members: int, quorum: float
) -> tuple[int, list[str]]:
    """Members now need other chunks, none joining or leaving: a mend re-chained chunks they use
    (db/chunks.rechain). ``uses`` gives per chunk how many more members use it (fewer where
    negative); returns (rows that changed tier, ids no member uses now). The member count, and so
    the threshold, is unchanged: only the chunks named can change tier. Always bumps the epoch:
    the re-chained chunks' rows in the members' documents changed, even where no tier moved."""
    bump_epoch(conn, family_id)
    more = [dict(family_id=family_id, chunk_id=c, users=n, tier=UNIQUE) for c, n in sorted(uses.items()) if n > 0]
    if more:
        stmt = insert(conn, fc)
        stmt = stmt.on_conflict_do_update(
            index_elements=[fc.c.family_id, fc.c.chunk_id], set_={"users": fc.c.users + stmt.excluded.users}
        )
        conn.execute(stmt, more)
    fewer = sorted(c for c, n in uses.items() if n < 0)
    if fewer:
        conn.execute(
            update(fc)
            .where(fc.c.family_id == family_id, fc.c.chunk_id == bindparam("cid"))
            .values(users=fc.c.users - bindparam("n")),
            [dict(cid=c, n=-uses[c]) for c in fewer],
        )
    dropped = _drop_unused(conn, family_id, fewer)
    return _retier(conn, family_id, [c for c, n in uses.items() if n], members, quorum), dropped


def _drop_unused(conn: Connection, family_id: int, ids: Sequence[str]) -> list[str]:
    """Delete the family's rows of those of ``ids`` that no member uses any more; returns their ids."""
    dropped: list[str] = []
    for batch in batches(list(ids)):
        dropped += conn.execute(
            select(fc.c.chunk_id).where(fc.c.family_id == family_id, fc.c.chunk_id.in_(batch), fc.c.users <= 0)
        ).scalars()
    for batch in batches(dropped):
        conn.execute(delete(fc).where(fc.c.family_id == family_id, fc.c.chunk_id.in_(batch)))
    return dropped


def recompute(conn: Connection, family_id: int, members: int, quorum: float) -> int:
    """Re-tier every chunk of a family (after a quorum change); returns rows that changed."""
    bump_epoch(conn, family_id)
    tier = _tier_expr(members, quorum)
    return conn.execute(update(fc).where(fc.c.family_id == family_id, fc.c.tier != tier).values(tier=tier)).rowcount


def tier_counts(conn: Connection, family_id: int) -> dict[str, int]:
    rows = conn.execute(select(fc.c.tier, func.count()).where(fc.c.family_id == family_id).group_by(fc.c.tier))
    return {t: n for t, n in rows}


def chunk_tiers(conn: Connection, family_id: int, tier: str | None = None) -> dict[str, tuple[str, int]]:
    """chunk id -> (tier, users) for a family's chunks, optionally of one tier."""
    q = select(fc.c.chunk_id, fc.c.tier, fc.c.users).where(fc.c.family_id == family_id)
    if tier is not None:
        q = q.where(and_(fc.c.tier == tier))
    return {c: (t, u) for c, t, u in conn.execute(q)}


def family_chunk_ids(conn: Connection, family_id: int, ids: Sequence[str]) -> set[str]:
    """The subset of ``ids`` that the family uses (directly or as a delta basis)."""
    found: set[str] = set()
    for batch in batches(list(ids)):
        found.update(
            conn.execute(select(fc.c.chunk_id).where(fc.c.family_id == family_id, fc.c.chunk_id.in_(batch))).scalars()
        )
    return found
