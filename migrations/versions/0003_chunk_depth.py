"""Delta chains: each chunk records how many deltas lie between it and a plain chunk

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("chunks") as batch_op:
        batch_op.add_column(sa.Column("depth", sa.Integer(), server_default="0", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("chunks") as batch_op:
        batch_op.drop_column("depth")
