"""Families count the changes to their members and tiers (families.epoch)

The epoch is part of the tag of a version document. Existing rows start at 0. Writers of the
previous release do not bump it, so during a rolling upgrade a node may keep out-of-date tiers,
never other bytes. See docs/design/node-cache.md.

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
