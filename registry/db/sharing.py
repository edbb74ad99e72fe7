"""Aggregate queries for sharing figures (registry/store/stats.py shapes them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, and_, case, exists, func, select

from mfsreg.registry.db.models import chunks, families, packs, unlisted_packs, versions
from mfsreg.registry.db.models import family_chunks as fc
from mfsreg.registry.db.models import version_chunks as vc
from mfsreg.registry.store.tiers import BASE, GROUP, TIERS, UNIQUE


def _family_id(name: str | None):
    return None if name is None else select(families.c.id).where(families.c.name == name).scalar_subquery()


def logical_bytes(conn: Connection, family: str | None) -> tuple[int, int]:
    q = select(func.coalesce(func.sum(versions.c.logical_bytes), 0), func.count())
    if family is not None:
        q = q.where(versions.c.family_id == _family_id(family))
    total, n = conn.execute(q).one()
    return int(total), int(n)


def tier_totals(conn: Connection, family: str | None) -> dict[str, tuple[int, int]]:
    """tier -> (chunks, stored bytes). Across families a chunk counts once, in its highest tier."""
    rows: Sequence[Sequence[Any]]  # (tier, chunks, stored bytes)
    if family is not None:
        q = (
            select(fc.c.tier, func.count(), func.coalesce(func.sum(chunks.c.stored_size), 0))
            .join(chunks, chunks.c.id == fc.c.chunk_id)
            .where(fc.c.family_id == _family_id(family))
            .group_by(fc.c.tier)
        )
        rows = conn.execute(q).all()
    else:
        rank = func.min(case((fc.c.tier == BASE, 0), (fc.c.tier == GROUP, 1), else_=2)).label("rank")
        best = select(fc.c.chunk_id, rank).group_by(fc.c.chunk_id).subquery()
        q = (
            select(best.c.rank, func.count(), func.coalesce(func.sum(chunks.c.stored_size), 0))
            .join(chunks, chunks.c.id == best.c.chunk_id)
            .group_by(best.c.rank)
        )
        rows = [(TIERS[r], n, b) for r, n, b in conn.execute(q)]
    out = {t: (0, 0) for t in (BASE, GROUP, UNIQUE)}
    for tier, n, b in rows:
        out[tier] = (int(n), int(b))
    return out


def encodings(conn: Connection, family: str | None) -> dict[str, tuple[int, int, int]]:
    """encoding -> (chunks, raw bytes, stored bytes) over the chunks in use."""
    used = select(fc.c.chunk_id).distinct()
    if family is not None:
        used = used.where(fc.c.family_id == _family_id(family))
    q = (
        select(chunks.c.encoding, func.count(), func.sum(chunks.c.size), func.sum(chunks.c.stored_size))
        .where(chunks.c.id.in_(used))
        .group_by(chunks.c.encoding)
    )
    return {e: (int(n), int(r), int(s)) for e, n, r, s in conn.execute(q)}


def version_figures(
    conn: Connection, family: str | None, seen: Sequence[int] | None = None
) -> list[tuple[int, str, str, int, int, int, int, int]]:
    """(version id, family, version, logical bytes, stored bytes it needs, stored bytes it alone holds, of what
    it needs: bytes stored as deltas, bytes stored plain). Alone: in the whole registry, or with
    ``seen`` (family ids) among those families only, so that no figure depends on the others."""
    # alone: its one user in its family, and no other family uses it (chunks are stored once for
    # the whole registry: a base pushed into two families is neither one's own)
    other = fc.alias("other_family")
    shared = (other.c.chunk_id == fc.c.chunk_id) & (other.c.family_id != fc.c.family_id)
    if seen is not None:
        shared = shared & other.c.family_id.in_(list(seen))
    elsewhere = exists().where(shared)
    alone = case((and_(fc.c.users == 1, ~elsewhere), chunks.c.stored_size), else_=0)
    delta = case((chunks.c.basis_id.is_not(None), chunks.c.stored_size), else_=0)
    per_version = (
        select(
            vc.c.version_id,
            func.sum(chunks.c.stored_size).label("needed"),
            func.sum(alone).label("alone"),
            func.sum(delta).label("delta"),
        )
        .join(versions, versions.c.id == vc.c.version_id)
        .join(fc, (fc.c.chunk_id == vc.c.chunk_id) & (fc.c.family_id == versions.c.family_id))
        .join(chunks, chunks.c.id == vc.c.chunk_id)
        .group_by(vc.c.version_id)
    )
    if family is not None:  # inside the aggregate: filtered after it, every family's rows were summed first
        per_version = per_version.where(
            versions.c.family_id.in_(select(families.c.id).where(families.c.name == family))
        )
    per = per_version.subquery()
    q = (
        select(
            versions.c.id,
            families.c.name,
            versions.c.name,
            versions.c.logical_bytes,
            func.coalesce(per.c.needed, 0),
            func.coalesce(per.c.alone, 0),
            func.coalesce(per.c.delta, 0),
        )
        .join(families, families.c.id == versions.c.family_id)
        .outerjoin(per, per.c.version_id == versions.c.id)
        .order_by(families.c.name, versions.c.id)
    )
    if family is not None:
        q = q.where(families.c.name == family)
    return [
        (int(i), f, v, int(lb), int(n), int(a), int(d), int(n) - int(d)) for i, f, v, lb, n, a, d in conn.execute(q)
    ]


def storage_totals(conn: Connection) -> tuple[int, int, int]:
    """(bytes in packs, stored bytes of recorded chunks that no family uses: deleted versions and
    interrupted pushes, bytes of unlisted packs: blobs prune retired, blobs a writer died before
    recording, and packs being written right now)."""
    pack_bytes = conn.execute(select(func.coalesce(func.sum(packs.c.size), 0))).scalar_one()
    unlisted = conn.execute(select(func.coalesce(func.sum(unlisted_packs.c.size), 0))).scalar_one()
    # NOT EXISTS, not NOT IN: Postgres hashes a NOT IN subquery only while it fits in work_mem
    # (about 130k family_chunks rows at the default 4 MB), and past that scans it again for every
    # chunk; a registry of 530k chunks did not finish in a minute (an anti-join: 0.17 s)
    orphan = conn.execute(
        select(func.coalesce(func.sum(chunks.c.stored_size), 0)).where(~exists().where(fc.c.chunk_id == chunks.c.id))
    ).scalar_one()
    return int(pack_bytes), int(orphan), int(unlisted)


def manifests(
    conn: Connection, family: str | None, version_ids: Sequence[int] | None = None
) -> list[tuple[int, int, bytes]]:
    """(version id, family id, stored manifest) of every version of ``family`` (or of all), or of
    those of ``version_ids``."""
    q = select(versions.c.id, versions.c.family_id, versions.c.manifest)
    if family is not None:
        q = q.where(versions.c.family_id == _family_id(family))
    if version_ids is not None:
        q = q.where(versions.c.id.in_(list(version_ids)))
    return [(int(v), int(f), bytes(m)) for v, f, m in conn.execute(q)]


def chunk_facts(conn: Connection, family: str | None) -> dict[tuple[int, str], tuple[str, int, int, bool]]:
    """(family id, chunk id) -> (tier in that family, raw size, stored size, stored as a delta)."""
    q = select(
        fc.c.family_id, fc.c.chunk_id, fc.c.tier, chunks.c.size, chunks.c.stored_size, chunks.c.basis_id.is_not(None)
    ).join(chunks, chunks.c.id == fc.c.chunk_id)
    if family is not None:
        q = q.where(fc.c.family_id == _family_id(family))
    return {(int(f), c): (t, int(n), int(s), bool(d)) for f, c, t, n, s, d in conn.execute(q)}


def family_totals(conn: Connection) -> dict[int, tuple[int, int, int]]:
    """family id -> (versions, logical bytes, stored bytes of the chunks it uses), every family in
    two grouped queries (the web page's list of families)."""
    out = {
        int(f): (int(n), int(b), 0)
        for f, n, b in conn.execute(
            select(versions.c.family_id, func.count(), func.coalesce(func.sum(versions.c.logical_bytes), 0)).group_by(
                versions.c.family_id
            )
        )
    }
    stored = select(fc.c.family_id, func.coalesce(func.sum(chunks.c.stored_size), 0)).join(
        chunks, chunks.c.id == fc.c.chunk_id
    )
    for f, b in conn.execute(stored.group_by(fc.c.family_id)):
        n, logical, _ = out.get(int(f), (0, 0, 0))
        out[int(f)] = (n, logical, int(b))
    return out
