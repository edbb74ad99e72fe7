"""Families count the changes to their members and tiers (families.epoch)

A node keeps the version documents it has read and asks for one again with If-None-Match; the
document's tag is the version's row id, its family's epoch, which every commit, delete and quorum
change bumps in the transaction that changes the family's tiers (registry/db/tiers.py), and its
digest. Existing rows start at 0. Writers of the previous release do not bump it: during a
rolling upgrade a node may keep a document whose tiers (advisory: they order the node cache's
evictions) are out of date until a writer of this release next changes the family; the digest
keeps it from ever taking other bytes for the version it kept.

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("families") as batch_op:
        batch_op.add_column(sa.Column("epoch", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        # as in 0005: batch mode would copy the table and break versions' foreign key
        op.execute("ALTER TABLE families DROP COLUMN epoch")
    else:
        op.drop_column("families", "epoch")
