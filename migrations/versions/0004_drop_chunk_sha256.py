"""Chunks drop their sha256: it was written at every push and read by nothing

A chunk is checked against its id (xxh3-128 of its raw bytes) wherever it is decoded, and every
rebuilt file against its whole-file sha256. The per-chunk sha256 added no check of its own (a
chunk found by id is never re-hashed), yet hashing every new chunk cost about a fifth of the CPU
of a push whose bytes are all new.

Revision ID: 0004
Revises: 0003
"""
from alembic import op
import sqlalchemy as sa

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("chunks") as batch_op:
        batch_op.drop_column("sha256")


def downgrade() -> None:
    # The digests are gone: rows get an empty string, which the code of revision 0003 never read.
    with op.batch_alter_table("chunks") as batch_op:
        batch_op.add_column(sa.Column("sha256", sa.String(64), server_default="", nullable=False))
