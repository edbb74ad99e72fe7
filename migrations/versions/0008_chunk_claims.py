"""Chunks a push uploaded to a family, before a commit uses them (chunk_claims)

A token scoped to some families could commit, by id alone, a chunk that only another family
uses, and then download its bytes. A commit by such a token now uses only chunks its family
already uses, chunks a family the token may read uses, or chunks a push to its family uploaded
(the server re-hashed their bytes): those are recorded here. Processes of the previous release
neither write nor check claims: during a rolling upgrade a commit that reaches a process of this
release after its chunks were uploaded through one of the previous release is answered
MissingChunks, and the client uploads them again.

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
