"""Queries on families and versions: create, lock, list, read, delete."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Connection, delete, func, select, update

from mfsreg.registry.db.dialect import batches, insert
from mfsreg.registry.db.models import families, family_chunks, version_chunks, versions
from mfsreg.registry.db.models import tags as tags_table
from mfsreg.registry.errors import NotFound, StorageError
from mfsreg.registry.meta import VersionMeta, labels_from_column, labels_to_column
from mfsreg.registry.results import FamilyRow, VersionRow

_FAMILY = (families.c.id, families.c.name, families.c.base_quorum, families.c.member_count, families.c.chunk_size)


def lock_family(conn: Connection, name: str, chunk_size: int | None = None) -> FamilyRow:
    """The family row, locked for this transaction (Postgres: FOR UPDATE; SQLite: the write lock is
    already held). Pushes to one family commit one after another; uploads still run side by side.
    With ``chunk_size``, a missing family is created, cut at that size."""
    if chunk_size is not None:
        conn.execute(insert(conn, families).values(name=name, chunk_size=chunk_size).on_conflict_do_nothing())
    q = select(*_FAMILY).where(families.c.name == name)
    if conn.dialect.name == "postgresql":
        q = q.with_for_update()
    row = conn.execute(q).first()
    if row is None:
        raise NotFound(f"family {name!r} does not exist: see `mfsreg ls`")
    return FamilyRow(*row)


def set_member_count(conn: Connection, family_id: int, count: int) -> None:
    conn.execute(update(families).where(families.c.id == family_id).values(member_count=count))


def set_quorum(conn: Connection, family_id: int, quorum: float) -> None:
    conn.execute(update(families).where(families.c.id == family_id).values(base_quorum=quorum))


def _version_query():
    parent = versions.alias("parent")
    return (
        select(
            versions.c.id,
            families.c.name,
            versions.c.name,
            parent.c.name,
            versions.c.digest,
            versions.c.logical_bytes,
            versions.c.file_count,
            versions.c.single_file,
            versions.c.created_at,
            versions.c.description,
            versions.c.labels,
            versions.c.pushed_by,
        )
        .join(families, families.c.id == versions.c.family_id)
        .outerjoin(parent, parent.c.id == versions.c.parent_id)
    )


def _row(r) -> VersionRow:
    return VersionRow(
        r[0], r[1], r[2], r[3], r[4], r[5], r[6], bool(r[7]), r[8], r[9], labels_from_column(r[10]), r[11]
    )


LATEST = "latest"  # names the family's last pushed version, unless a tag of that name is set by hand


def _named(conn: Connection, family: str, name: str, tags: bool, extra=()):
    """The row of version ``name``, or with ``tags`` of the version the tag ``name`` names (a
    version's own name first; then a tag; then ``latest``, the last pushed)."""
    q = _version_query().add_columns(*extra).where(families.c.name == family)
    r = conn.execute(q.where(versions.c.name == name)).first()
    if r is not None or not tags:
        return r
    tagged = (
        select(tags_table.c.version_id)
        .join(families, families.c.id == tags_table.c.family_id)
        .where(families.c.name == family, tags_table.c.name == name)
        .scalar_subquery()
    )
    r = conn.execute(q.where(versions.c.id == tagged)).first()
    if r is None and name == LATEST:
        r = conn.execute(q.order_by(versions.c.id.desc()).limit(1)).first()
    return r


def find_version(conn: Connection, family: str, name: str, tags: bool = False) -> VersionRow | None:
    """The version named ``name`` (with ``tags``, also the one a tag of that name names); None if absent."""
    r = _named(conn, family, name, tags)
    return _row(r) if r else None


def find_version_and_epoch(conn: Connection, family: str, name: str) -> tuple[VersionRow, int] | None:
    """The version ``name`` names (a tag too) and its family's epoch (service.version_doc's tag);
    None if absent."""
    r = _named(conn, family, name, True, (families.c.epoch,))
    return (_row(r), r[-1]) if r else None


def find_by_digest(conn: Connection, family: str, hex_prefix: str) -> VersionRow | None:
    """The family's oldest version whose digest starts with ``hex_prefix`` (hex digits, checked by
    the caller), or None."""
    q = _version_query().where(families.c.name == family, versions.c.digest.startswith(f"sha256:{hex_prefix}"))
    r = conn.execute(q.order_by(versions.c.id).limit(1)).first()
    return _row(r) if r else None


def get_version(conn: Connection, family: str, name: str, tags: bool = True) -> VersionRow:
    """As find_version, else NotFound saying whether the family or the version is missing."""
    row = find_version(conn, family, name, tags)
    if row is None:
        if conn.execute(select(families.c.id).where(families.c.name == family)).first() is None:
            raise NotFound(f"family {family!r} does not exist: see `mfsreg ls`")
        raise NotFound(f"version {family}/{name} does not exist: see `mfsreg ls {family}`")
    return row


def list_versions(conn: Connection, family: str | None = None) -> list[VersionRow]:
    q = _version_query().order_by(families.c.name, versions.c.id)
    if family is not None:
        q = q.where(families.c.name == family)
    return [_row(r) for r in conn.execute(q)]


def list_families(conn: Connection) -> list[FamilyRow]:
    q = select(*_FAMILY).order_by(families.c.name)
    return [FamilyRow(*r) for r in conn.execute(q)]


def get_family(conn: Connection, name: str) -> FamilyRow:
    q = select(*_FAMILY).where(families.c.name == name)
    row = conn.execute(q).first()
    if row is None:
        raise NotFound(f"family {name!r} does not exist: see `mfsreg ls`")
    return FamilyRow(*row)


def family_exists(conn: Connection, name: str) -> bool:
    return conn.execute(select(families.c.id).where(families.c.name == name)).first() is not None


def read_manifest(conn: Connection, version_id: int) -> bytes:
    return conn.execute(select(versions.c.manifest).where(versions.c.id == version_id)).scalar_one()


def insert_version(
    conn: Connection,
    family_id: int,
    name: str,
    parent_id: int | None,
    digest: str,
    logical_bytes: int,
    file_count: int,
    single_file: bool,
    manifest: bytes,
    chunk_ids: Sequence[str],
    meta: VersionMeta | None = None,
    pushed_by: str = "",
) -> int:
    meta = meta or VersionMeta()
    key = conn.execute(
        versions.insert().values(
            family_id=family_id,
            name=name,
            parent_id=parent_id,
            digest=digest,
            logical_bytes=logical_bytes,
            file_count=file_count,
            single_file=int(single_file),
            manifest=manifest,
            description=meta.description,
            labels=labels_to_column(meta.labels),
            pushed_by=pushed_by[:160],
        )
    ).inserted_primary_key
    if key is None:  # SQLAlchemy's answer where a database returned no id: not for a one-row insert
        raise StorageError(f"the database returned no id for new version {name}")
    vid = key[0]
    for batch in batches(list(chunk_ids), 5000):
        conn.execute(version_chunks.insert(), [dict(version_id=vid, chunk_id=c) for c in batch])
    return vid


def version_chunk_ids(conn: Connection, version_id: int) -> list[str]:
    return list(
        conn.execute(select(version_chunks.c.chunk_id).where(version_chunks.c.version_id == version_id)).scalars()
    )


def chunk_ids_by_version(conn: Connection, family: str | None = None) -> dict[int, list[str]]:
    """version id -> the chunk ids it needs (version_chunk_ids), for one family's versions or every
    version, in one query."""
    q = select(version_chunks.c.version_id, version_chunks.c.chunk_id)
    if family is not None:
        q = (
            q.join(versions, versions.c.id == version_chunks.c.version_id)
            .join(families, families.c.id == versions.c.family_id)
            .where(families.c.name == family)
        )
    out: dict[int, list[str]] = {}
    for vid, cid in conn.execute(q):
        out.setdefault(vid, []).append(cid)
    return out


def delete_version(conn: Connection, version_id: int) -> None:
    # Children keep their lineage: they now descend from the deleted version's own parent (none for a root).
    grandparent = conn.execute(select(versions.c.parent_id).where(versions.c.id == version_id)).scalar_one()
    conn.execute(delete(version_chunks).where(version_chunks.c.version_id == version_id))
    conn.execute(update(versions).where(versions.c.parent_id == version_id).values(parent_id=grandparent))
    conn.execute(delete(versions).where(versions.c.id == version_id))


def count_versions(conn: Connection, family_id: int) -> int:
    return conn.execute(
        select(func.count()).select_from(versions).where(versions.c.family_id == family_id)
    ).scalar_one()


def most_shared_version(conn: Connection, family_id: int, ids: Sequence[str], member_count: int) -> int | None:
    """The member of the family that uses the most of ``ids`` (ties: the oldest); None if every one
    of ``ids`` that the family uses, every member uses (then all tie: the caller takes the oldest)."""
    # A chunk every member uses adds one to every member's count and changes neither the winner nor
    # the ties, yet it costs one version_chunks row per member: a family's base tier would make
    # this lookup grow with the family. Only the chunks some members lack are counted.
    counts: dict[int, int] = {}
    for batch in batches(list(ids)):
        lacked = select(family_chunks.c.chunk_id).where(
            family_chunks.c.family_id == family_id,
            family_chunks.c.chunk_id.in_(batch),
            family_chunks.c.users < member_count,
        )
        q = (
            select(version_chunks.c.version_id, func.count())
            .join(versions, versions.c.id == version_chunks.c.version_id)
            .where(versions.c.family_id == family_id, version_chunks.c.chunk_id.in_(lacked))
            .group_by(version_chunks.c.version_id)
        )
        for vid, n in conn.execute(q):
            counts[vid] = counts.get(vid, 0) + n
    if not counts:
        return None
    return max(counts, key=lambda v: (counts[v], -v))


def first_version(conn: Connection, family_id: int) -> int | None:
    return conn.execute(select(func.min(versions.c.id)).where(versions.c.family_id == family_id)).scalar()


def find_family(conn: Connection, name: str) -> FamilyRow | None:
    q = select(*_FAMILY).where(families.c.name == name)
    row = conn.execute(q).first()
    return FamilyRow(*row) if row else None
