"""Chunks stop recording a sha256 of their own: the column becomes nullable and is no longer written

A chunk is checked against its id (xxh3-128 of its raw bytes) wherever it is decoded, and every
rebuilt file is checked too. The per-chunk sha256 added no check of its own (a
chunk found by id is never hashed again, and nothing read the column), yet hashing every new
chunk cost about a fifth of the CPU of a push whose bytes are all new.

The column stays, nullable, for one release: API processes of the previous release still write
and select it, so a rolling upgrade (migrate, then replace processes one by one) keeps working.
A later migration drops it once no such process can be running.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("chunks") as batch_op:
        batch_op.alter_column("sha256", existing_type=sa.String(64), nullable=True)


def downgrade() -> None:
    # Rows written since have no digest: an empty string, which the code of revision 0003 never read.
    op.execute("UPDATE chunks SET sha256 = '' WHERE sha256 IS NULL")
    with op.batch_alter_table("chunks") as batch_op:
        batch_op.alter_column("sha256", existing_type=sa.String(64), nullable=False)
