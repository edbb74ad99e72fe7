"""Which stored chunks a push may use without sending their bytes.

Chunks are stored once for the whole registry, so a chunk id names the same bytes in every family.
A token scoped to some families must not gain another family's bytes by naming their ids: a push
through it that committed an id only another family uses could then download those bytes through
its own family. So a push through such a token uses a stored chunk without uploading it only
where its own family already uses it, or a family the token may read does (the token could
download it there anyway). Any other chunk is asked for (negotiate lists it as missing) and,
once uploaded and re-hashed by the server, claimed for the family (db/claims.py): the commit
checks that every chunk passes one of the three. The registry still keeps one copy of the bytes.

A token for every family (pattern ``*``), and an embedded push, may use every stored chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Connection

from registry.auth import Principal
from registry.db import claims as claim_db
from registry.db import versions as version_db


def reads_everything(who: Principal | None) -> bool:
    return who is None or (who.family_pattern == "*" and who.allows("read", None))


def unproven(conn: Connection, who: Principal | None, family: str, stored: Sequence[str]) -> set[str]:
    """Those of the ``stored`` chunk ids a push to ``family`` through ``who`` must upload before a
    commit may use them."""
    if reads_everything(who) or not stored:
        return set()
    # a push role includes read, so the family pushed to is among them
    readable = [f.id for f in version_db.list_families(conn) if who.allows("read", f.name)]
    todo = set(stored) - claim_db.used_by_families(conn, readable, list(stored))
    return todo - claim_db.claimed(conn, family, list(todo)) if todo else todo
