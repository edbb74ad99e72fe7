"""Chunks a push uploaded to a family, before a commit uses them (chunk_claims)

A scoped token's commit may use the chunks claimed here (docs/design/protocol.md). Processes of the
previous release neither write nor check claims: during a rolling upgrade a commit may be answered
MissingChunks for chunks uploaded through one of them, and the client uploads them again.

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "chunk_claims",
        sa.Column("family", sa.String(128), nullable=False),
        sa.Column("chunk_id", sa.String(32), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.PrimaryKeyConstraint("family", "chunk_id", name=op.f("pk_chunk_claims")),
    )


def downgrade() -> None:
    op.drop_table("chunk_claims")
