"""Drop chunks.sha256, and bring databases built by pre-release migrations to the same schema

Migration 0004 kept chunks.sha256, nullable, for one release, so that processes of the release
before it could go on writing it during a rolling upgrade; no process of a release since reads or
writes it, so it goes now.

Two migrations changed after they had been committed, so a database upgraded by the earlier text
holds the revision without its tables:
- 0004, as first committed (9cb7f29), dropped chunks.sha256 at once: such a database has no
  column to drop.
- 0006, as first committed (58d9a58), created ``retired_packs (id, size, retired_at)``; the
  text after it (d5c4a01) ``unlisted_packs (id, size, since)``; the one since (ca2bf7e) adds
  ``claimed_at``. Such a database lacks unlisted_packs or its claimed_at, and prune and every
  writer failed on it. The retired packs' rows move over, retired_at as ``since``, so their blobs
  are still deleted after the grace period.
Each step looks at what the database holds, so one upgrade serves every such history. Alembic's
own record (alembic_version) cannot tell them apart; only the tables can.

Revision ID: 0010
Revises: 0009
"""
from alembic import op
import sqlalchemy as sa

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def _columns(inspector: sa.Inspector, table: str) -> set[str]:
    return {c["name"] for c in inspector.get_columns(table)}


def upgrade() -> None:
    conn = op.get_bind()
    inspector = sa.inspect(conn)
    tables = set(inspector.get_table_names())

    if "sha256" in _columns(inspector, "chunks"):
        _drop_column("chunks", "sha256")

    if "unlisted_packs" not in tables:
        op.create_table(
            "unlisted_packs",
            sa.Column("id", sa.String(length=32), nullable=False),
            sa.Column("size", sa.BigInteger(), nullable=False),
            sa.Column("since", sa.DateTime(timezone=True), server_default=sa.text("(CURRENT_TIMESTAMP)"), nullable=False),
            sa.Column("claimed_at", sa.DateTime(timezone=True), nullable=True),
            sa.PrimaryKeyConstraint("id", name=op.f("pk_unlisted_packs")),
        )
    elif "claimed_at" not in _columns(inspector, "unlisted_packs"):
        # a nullable column with no default: added in place on SQLite and Postgres alike
        op.add_column("unlisted_packs", sa.Column("claimed_at", sa.DateTime(timezone=True), nullable=True))

    if "retired_packs" in tables:
        op.execute("INSERT INTO unlisted_packs (id, size, since) SELECT id, size, retired_at FROM retired_packs "
                   "WHERE id NOT IN (SELECT id FROM unlisted_packs)")
        op.drop_table("retired_packs")


def _drop_column(table: str, column: str) -> None:
    if op.get_bind().dialect.name == "sqlite":
        # Batch mode would copy the table, and dropping the old one breaks the foreign keys that
        # point at it; SQLite drops a plain column in place since 3.35 (as in 0005's downgrade).
        op.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    else:
        op.drop_column(table, column)


def downgrade() -> None:
    # The column 0004 left, empty: 0004's own downgrade fills it for the code of revision 0003.
    # The repairs stay: revision 0009's code expects the tables they made.
    op.add_column("chunks", sa.Column("sha256", sa.String(64), nullable=True))
