"""The metadata tables. Changed only through Alembic migrations (migrations/versions/).

- families: one row per family, with its tier policy (base_quorum), member count and chunk size
  (fixed by its first push: members dedup against each other only if cut alike).
- versions: one immutable row per version, written in the same transaction as its chunk uses, so a
  version is visible only once all of its chunks are durable. ``manifest`` is the zstd-compressed
  JSON that rebuilds it byte for byte.
- packs / chunks: where each distinct chunk is stored and how it is encoded. A chunk row is written
  only after its pack is durable; rows no version uses yet (an interrupted push) let a re-run skip
  what was already sent.
- unlisted_packs: pack blobs that no chunk row may point into: one a writer announced before
  writing it (moved to packs when recorded; a writer that dies leaves it here), or one prune
  retired. Prune (registry/prune.py) claims each once ``since`` is older than its grace period (so
  that a pull which located chunks in a retired pack just before can finish), deletes the blob,
  then the row.
- version_chunks: which distinct chunks each version needs (for stats, tiers and delete): its own and
  the bases of their deltas, down the chains; written by its commit, and again by a mend that changes
  the chain of one of them (db/chunks.rechain).
- family_chunks: per family and chunk, how many members use it and its tier; rebalanced
  incrementally (registry/tiers.py) so a push never re-reads every member.
- chunk_claims: chunks a push to a family uploaded (bytes re-hashed by the server), so its commit
  may use them although the family does not use them yet: a token scoped to some families commits
  only chunks it proved it holds, or that a family it may read already uses (registry/access.py).
  Dropped by the commit that uses them, or by prune once older than its grace period.
- tokens: API bearer tokens, stored only as sha256 hashes, each with a role and a family pattern.
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
    # Bumped by every change to the family's members or tiers (db/tiers.py): with a version's id and
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
    UniqueConstraint("family_id", "name"),
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
    Column("basis_id", CHUNK_ID, nullable=True),  # for delta encodings: the chunk this one is xor'ed against
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
)
