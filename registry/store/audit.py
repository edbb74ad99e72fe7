"""The audit log: who deleted a version, pruned, changed a family's quorum, created or revoked a
token, and when. Each entry is written in the transaction of what it records (a prune's, once it
has run). Admins read it: `mfsreg audit`, GET /v1/audit.
See docs/server.md.
"""

from __future__ import annotations

import getpass
import json

from sqlalchemy import Connection

from mfsreg.registry.db import auditlog as audit_db
from mfsreg.registry.db.engine import read_tx
from mfsreg.registry.errors import Forbidden
from mfsreg.registry.principal import Principal

DETAIL_MAX = 1024


def actor_of(who: Principal | None) -> str:
    """How an entry names who acted: a token by its prefix (as `token list` shows it), the embedded
    CLI as local:<the OS user>."""
    if who is not None and who.token_prefix:
        return who.token_prefix
    if who is not None and who.anonymous:
        return "anonymous"
    try:
        return f"local:{getpass.getuser()}"[:64]
    except (KeyError, OSError):  # no name for this uid (a container's)
        return "local"


def named(who: Principal | None) -> str:
    """actor_of with the token's description: who pushed a version, who moved a tag."""
    actor = actor_of(who)
    if who is not None and who.token_description:
        actor = f"{actor} ({who.token_description})"
    return actor[:160]


def record(conn: Connection, who: Principal | None, action: str, family: str | None = None, **detail) -> None:
    """One entry for ``action`` (delete, prune, quorum, token-create, token-revoke) by ``who``."""
    text = json.dumps(detail, separators=(",", ":"), sort_keys=True, default=str)
    audit_db.insert(conn, actor_of(who), action, family, text[:DETAIL_MAX])


def entries(engine, who: Principal | None, limit: int = 100) -> list[audit_db.AuditRow]:
    """The newest ``limit`` entries ``who`` may read: every one for the embedded CLI and an admin for
    every family; those about its families for an admin limited to some."""
    if who is not None and not who.allows("admin", None):
        raise Forbidden(f"this token has role {who.role!r}; the audit log needs 'admin'")
    everything = who is None or who.family_pattern == "*"
    out = []
    with read_tx(engine) as conn:
        for row in audit_db.newest_first(conn, with_family=not everything):
            if everything or (who is not None and who.allows("admin", row.family)):
                out.append(row)
                if len(out) >= limit:
                    break
    return out
