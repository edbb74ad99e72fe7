"""Queries on tags and their history (registry/store/tags.py says the rules)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Connection, delete, select, update

from mfsreg.registry.db.models import tag_events, tags, versions
from mfsreg.registry.results import TagEvent, TagRow


def find(conn: Connection, family_id: int, name: str) -> tuple[int, str] | None:
    """(version id, version name) the tag ``name`` names, or None."""
    r = conn.execute(
        select(tags.c.version_id, versions.c.name)
        .join(versions, versions.c.id == tags.c.version_id)
        .where(tags.c.family_id == family_id, tags.c.name == name)
    ).first()
    return (r[0], r[1]) if r else None


def list_tags(conn: Connection, family_id: int) -> list[TagRow]:
    q = (
        select(tags.c.name, versions.c.name, tags.c.set_by, tags.c.set_at)
        .join(versions, versions.c.id == tags.c.version_id)
        .where(tags.c.family_id == family_id)
        .order_by(tags.c.name)
    )
    return [TagRow(*r) for r in conn.execute(q)]


def put(conn: Connection, family_id: int, name: str, version_id: int, actor: str, now: datetime) -> None:
    """Point the tag at ``version_id``, made if missing (the caller holds the family's lock)."""
    done = conn.execute(
        update(tags)
        .where(tags.c.family_id == family_id, tags.c.name == name)
        .values(version_id=version_id, set_by=actor, set_at=now)
    )
    if not done.rowcount:
        conn.execute(
            tags.insert().values(family_id=family_id, name=name, version_id=version_id, set_by=actor, set_at=now)
        )


def remove(conn: Connection, family_id: int, name: str) -> None:
    conn.execute(delete(tags).where(tags.c.family_id == family_id, tags.c.name == name))


def of_version(conn: Connection, version_id: int) -> list[str]:
    """The tags that name ``version_id``."""
    return list(
        conn.execute(select(tags.c.name).where(tags.c.version_id == version_id).order_by(tags.c.name)).scalars()
    )


def record(
    conn: Connection, family_id: int, tag: str, before: str | None, after: str | None, actor: str, now: datetime
) -> None:
    conn.execute(
        tag_events.insert().values(
            family_id=family_id, tag=tag, from_version=before, to_version=after, actor=actor, at=now
        )
    )


def history(conn: Connection, family_id: int, tag: str | None = None, limit: int = 1000) -> list[TagEvent]:
    """The newest ``limit`` moves of the family's tags (of one, with ``tag``), newest first."""
    q = select(
        tag_events.c.tag, tag_events.c.from_version, tag_events.c.to_version, tag_events.c.actor, tag_events.c.at
    )
    q = q.where(tag_events.c.family_id == family_id)
    if tag is not None:
        q = q.where(tag_events.c.tag == tag)
    return [TagEvent(*r) for r in conn.execute(q.order_by(tag_events.c.id.desc()).limit(limit))]
