"""Queries on the audit log (registry/store/audit.py says what is recorded)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, select

from mfsreg.registry.db.models import audit_log


@dataclass(frozen=True)
class AuditRow:
    id: int
    at: datetime
    actor: str
    action: str
    family: str | None
    detail: str


def insert(conn: Connection, actor: str, action: str, family: str | None, detail: str) -> None:
    conn.execute(audit_log.insert().values(actor=actor, action=action, family=family, detail=detail))


def newest_first(conn: Connection, with_family: bool = False, batch: int = 500) -> Iterator[AuditRow]:
    """Every entry, newest first (``with_family``: only those about one family), read in batches."""
    before = None
    cols = (
        audit_log.c.id,
        audit_log.c.at,
        audit_log.c.actor,
        audit_log.c.action,
        audit_log.c.family,
        audit_log.c.detail,
    )
    while True:
        q = select(*cols).order_by(audit_log.c.id.desc()).limit(batch)
        if with_family:
            q = q.where(audit_log.c.family.is_not(None))
        if before is not None:
            q = q.where(audit_log.c.id < before)
        rows = [AuditRow(*r) for r in conn.execute(q)]
        yield from rows
        if len(rows) < batch:
            return
        before = rows[-1].id
