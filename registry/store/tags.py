"""Tags: movable names of versions within a family (``prod``, ``staging``, ``latest``).

A family's tags and version names are one namespace: a tag may not take a version's name, and a
push may not take a tag's. Wherever a version is named (pull, show, load_tensors, switch, the Hub
API) a tag works too; a version's own name wins. ``latest`` names the last pushed version until a
tag of that name is set by hand (`tag rm` returns it to following pushes). Moving a tag needs a
push token for its family; each move is kept (tag_events) with who made it and when.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING

from sqlalchemy import Connection

from mfsreg.registry.db import tagrefs as tag_db
from mfsreg.registry.db import versions as version_db
from mfsreg.registry.db.engine import read_tx, write_tx
from mfsreg.registry.errors import Conflict, NotFound
from mfsreg.registry.names import check_name, check_new_name
from mfsreg.registry.results import TagEvent, TagMove, TagRow

if TYPE_CHECKING:
    from mfsreg.registry.auth import Principal

LATEST = version_db.LATEST


def named(who: Principal | None) -> str:
    """Who moved a tag (registry/audit.named), loaded only by what changes a tag: `ls` stays light."""
    from mfsreg.registry.store.audit import named as audit_named

    return audit_named(who)


def set_tag(engine, family: str, tag: str, version: str, who: Principal | None = None) -> TagMove:
    """Point ``tag`` at ``version`` (a version's name, or another tag), recorded as moved by ``who``."""
    check_name("family", family)
    check_new_name("tag", tag)
    check_name("version", version)
    if who is not None:
        who.require("push", family)
    with write_tx(engine) as conn:
        fam = version_db.lock_family(conn, family)
        if version_db.find_version(conn, family, tag) is not None:
            raise Conflict(f"{family}/{tag} is a version: a tag may not take a version's name; choose another tag name")
        target = version_db.get_version(conn, family, version)
        held = tag_db.find(conn, fam.id, tag)
        before = held[1] if held else None
        if held is not None and held[0] == target.id:
            return TagMove(family, tag, before, target.name)
        now = datetime.now(UTC)
        actor = named(who)
        tag_db.put(conn, fam.id, tag, target.id, actor, now)
        tag_db.record(conn, fam.id, tag, before, target.name, actor, now)
    return TagMove(family, tag, before, target.name)


def remove_tag(engine, family: str, tag: str, who: Principal | None = None) -> TagMove:
    """Remove ``tag`` (``latest`` follows pushes again), recorded as removed by ``who``."""
    check_name("family", family)
    check_name("tag", tag)
    if who is not None:
        who.require("push", family)
    with write_tx(engine) as conn:
        fam = version_db.lock_family(conn, family)
        held = tag_db.find(conn, fam.id, tag)
        if held is None:
            if tag == LATEST:
                raise NotFound(f"tag {family}/latest is not set by hand: it follows the last pushed version")
            raise NotFound(f"tag {family}/{tag} does not exist: see `mfsreg tag ls {family}`")
        now = datetime.now(UTC)
        tag_db.remove(conn, fam.id, tag)
        tag_db.record(conn, fam.id, tag, held[1], None, named(who), now)
    return TagMove(family, tag, held[1], None)


def list_tags(engine, family: str) -> list[TagRow]:
    """The family's tags by name, ``latest`` among them (automatic while not set by hand)."""
    check_name("family", family)
    with read_tx(engine) as conn:
        fam = version_db.get_family(conn, family)
        rows = tag_db.list_tags(conn, fam.id)
        if all(r.name != LATEST for r in rows) and version_db.find_version(conn, family, LATEST) is None:
            last = version_db.find_version(conn, family, LATEST, tags=True)
            if last is not None:
                rows.append(TagRow(LATEST, last.name, last.pushed_by, last.created_at, automatic=True))
    return sorted(rows, key=lambda r: r.name)


def history(engine, family: str, tag: str | None = None, limit: int = 1000) -> list[TagEvent]:
    """Every move of the family's tags (or of ``tag``), newest first."""
    check_name("family", family)
    if tag is not None:
        check_name("tag", tag)
    with read_tx(engine) as conn:
        fam = version_db.get_family(conn, family)
        return tag_db.history(conn, fam.id, tag, limit)


def drop_for_version(conn: Connection, family_id: int, version_id: int, version: str, who: Principal | None) -> None:
    """Before ``version`` is deleted: the tags that name it go, each move recorded."""
    now = datetime.now(UTC)
    for tag in tag_db.of_version(conn, version_id):
        tag_db.remove(conn, family_id, tag)
        tag_db.record(conn, family_id, tag, version, None, named(who), now)


def check_free(conn: Connection, family: str, version: str) -> None:
    """A push may not take the name of one of the family's tags (nor ``latest``)."""
    fam = version_db.find_family(conn, family)
    held = tag_db.find(conn, fam.id, version) if fam is not None else None
    if held is not None:
        raise Conflict(
            f"{family}/{version} is a tag (of version {held[1]}): a version may not take a tag's name; "
            f"choose another version name, or remove the tag first (`mfsreg tag rm {family} {version}`)"
        )
