"""Bring databases built by pre-release texts of migrations 0004 and 0006 to the same schema

Each step looks at what the database holds: chunks.sha256 is added back (nullable, empty) where
missing; unlisted_packs is created, or given its claimed_at, where missing; rows of retired_packs
move to unlisted_packs (retired_at as ``since``) and retired_packs is dropped. On a database the
current texts built it changes nothing; downgrade keeps the repairs.

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def _columns(inspector: sa.Inspector, table: str) -> set[str]:
    return {c["name"] for c in inspector.get_columns(table)}


def upgrade() -> None:
    inspector = sa.inspect(op.get_bind())
    tables = set(inspector.get_table_names())

    # Nullable columns without a default: added in place on SQLite and Postgres alike.
    if "sha256" not in _columns(inspector, "chunks"):
        op.add_column("chunks", sa.Column("sha256", sa.String(64), nullable=True))

    if "unlisted_packs" not in tables:
        # 0006's table as it stands (a migration keeps its own copy: later code may change)
        op.create_table(
            "unlisted_packs",
            sa.Column("id", sa.String(length=32), nullable=False),
            sa.Column("size", sa.BigInteger(), nullable=False),
            sa.Column(
                "since", sa.DateTime(timezone=True), server_default=sa.text("(CURRENT_TIMESTAMP)"), nullable=False
            ),
            sa.Column("claimed_at", sa.DateTime(timezone=True), nullable=True),
            sa.PrimaryKeyConstraint("id", name=op.f("pk_unlisted_packs")),
        )
    elif "claimed_at" not in _columns(inspector, "unlisted_packs"):
        op.add_column("unlisted_packs", sa.Column("claimed_at", sa.DateTime(timezone=True), nullable=True))

    if "retired_packs" in tables:
        op.execute(
            "INSERT INTO unlisted_packs (id, size, since) SELECT id, size, retired_at FROM retired_packs "
            "WHERE id NOT IN (SELECT id FROM unlisted_packs)"
        )
        op.drop_table("retired_packs")


def downgrade() -> None:
    # The repairs stay: the code of revision 0009 expects the schema they made.
    pass
