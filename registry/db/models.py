"""The metadata tables, changed only through Alembic migrations (migrations/versions/).

- families: base_quorum, member count, chunk size, epoch
- versions: one immutable row each, with its manifest
- packs, chunks: where each distinct chunk is stored, and how
- unlisted_packs: blobs no chunk row may point into, for prune
- version_chunks: what each version needs, delta bases included
- family_chunks: each family's chunks, their users and tier
- chunk_claims: a scoped push's uploads, until its commit
- tokens: API tokens as sha256 hashes, with role, family pattern, expiry and last use
- audit_log: who deleted, pruned, changed a quorum or a token, and when
- tags, tag_events: movable names of versions, and each move
See docs/design/format.md, tiers.md and prune.md.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    func,
)

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

CHUNK_ID = String(32)  # xxh3-128, hex

families = Table(
    "families",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("name", String(128), nullable=False, unique=True),
    Column("base_quorum", Float, nullable=False, server_default="1.0"),
    Column("member_count", Integer, nullable=False, server_default="0"),
    # Rows of releases before 0005 were cut at 1 MiB, that release's default (migrations/versions/0005).
    Column("chunk_size", Integer, nullable=False, server_default=str(1 << 20)),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    # Bumped by every change to the family's members or tiers (db/rebalance.py): with a version's id and
    # digest it tags the version document a node keeps (migrations/versions/0007).
    Column("epoch", Integer, nullable=False, server_default="0"),
)

versions = Table(
    "versions",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("family_id", Integer, ForeignKey("families.id"), nullable=False),
    Column("name", String(128), nullable=False),
    Column("parent_id", Integer, ForeignKey("versions.id"), nullable=True),
    Column("digest", String(71), nullable=False),
    Column("logical_bytes", BigInteger, nullable=False),
    Column("file_count", Integer, nullable=False),
    Column("single_file", Integer, nullable=False),
    Column("manifest", LargeBinary, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("description", String(1024), nullable=False, server_default=""),
    Column("labels", Text, nullable=False, server_default="{}"),  # a JSON object of strings (registry/meta.py)
    Column("pushed_by", String(160), nullable=False, server_default=""),  # as tag_events.actor names it
    UniqueConstraint("family_id", "name"),
)

# movable names of versions; a family's tags and version names are one namespace (registry/store/tags.py)
tags = Table(
    "tags",
    metadata,
    Column("family_id", Integer, ForeignKey("families.id"), primary_key=True),
    Column("name", String(128), primary_key=True),
    Column("version_id", Integer, ForeignKey("versions.id"), nullable=False, index=True),
    Column("set_by", String(160), nullable=False, server_default=""),
    Column("set_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

# every move of a tag: set (from null), moved, removed (to null), or dropped with its version
tag_events = Table(
    "tag_events",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("family_id", Integer, ForeignKey("families.id"), nullable=False, index=True),
    Column("tag", String(128), nullable=False),
    Column("from_version", String(128), nullable=True),
    Column("to_version", String(128), nullable=True),
    Column("actor", String(160), nullable=False),
    Column("at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

packs = Table(
    "packs",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("size", BigInteger, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

unlisted_packs = Table(
    "unlisted_packs",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("size", BigInteger, nullable=False),
    Column("since", DateTime(timezone=True), nullable=False, server_default=func.now()),
    # set when prune claims the pack for deletion; the row goes once the blob is deleted, so a
    # prune that dies in between leaves the claim for the next one instead of an unnamed blob
    Column("claimed_at", DateTime(timezone=True), nullable=True),
)

chunks = Table(
    "chunks",
    metadata,
    Column("id", CHUNK_ID, primary_key=True),
    Column("size", BigInteger, nullable=False),
    # No longer written (migration 0004); kept, nullable, while processes of the release before it
    # may still write and select it during a rolling upgrade. A migration of a later release, one
    # that no such process can meet, drops it.
    Column("sha256", String(64), nullable=True),
    Column("encoding", String(16), nullable=False),
    Column("stored_size", BigInteger, nullable=False),
    Column("pack_id", String(32), ForeignKey("packs.id"), nullable=False),
    Column("offset", BigInteger, nullable=False),
    Column("basis_id", CHUNK_ID, nullable=True),  # for delta encodings: the chunk this one is a delta against
    Column("depth", Integer, nullable=False, server_default="0"),  # delta chain length down to a plain chunk
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Index(None, "basis_id"),
    Index(None, "pack_id"),  # prune's per-pack lookups, and Postgres' foreign-key check on deleting a pack
)

version_chunks = Table(
    "version_chunks",
    metadata,
    Column("version_id", Integer, ForeignKey("versions.id", ondelete="CASCADE"), primary_key=True),
    Column("chunk_id", CHUNK_ID, primary_key=True),
    Index(None, "chunk_id"),
)

family_chunks = Table(
    "family_chunks",
    metadata,
    Column("family_id", Integer, ForeignKey("families.id"), primary_key=True),
    Column("chunk_id", CHUNK_ID, primary_key=True),
    Column("users", Integer, nullable=False),
    Column("tier", String(8), nullable=False),
    Index(None, "family_id", "users"),
    Index(None, "family_id", "tier"),
    Index(None, "chunk_id"),
)

chunk_claims = Table(
    "chunk_claims",
    metadata,
    # the family's name, not its id: a first push uploads before its family row exists
    Column("family", String(128), primary_key=True),
    Column("chunk_id", CHUNK_ID, primary_key=True),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

tokens = Table(
    "tokens",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("token_hash", String(64), nullable=False, unique=True),
    Column("prefix", String(16), nullable=False),  # first characters, to tell tokens apart in listings
    Column("role", String(8), nullable=False),
    Column("family_pattern", String(128), nullable=False),
    Column("description", String(256), nullable=False, server_default=""),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("revoked_at", DateTime(timezone=True), nullable=True),
    Column("expires_at", DateTime(timezone=True), nullable=True),  # refused after it; null: never
    Column("last_used_at", DateTime(timezone=True), nullable=True),  # kept to the minute
)

# who did what: deletes, prunes, quorum changes, token creation and revocation (registry/store/audit.py)
audit_log = Table(
    "audit_log",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("at", DateTime(timezone=True), nullable=False, server_default=func.now(), index=True),
    Column("actor", String(64), nullable=False),  # a token's prefix, or local:<user> for the embedded CLI
    Column("action", String(32), nullable=False),
    Column("family", String(128), nullable=True),
    Column("detail", String(1024), nullable=False, server_default=""),
)
