"""Chunks stop recording a sha256 of their own: the column becomes nullable and is no longer written

The column stays, nullable: API processes of the previous release still write and select it, so a
rolling upgrade (migrate, then replace processes one by one) keeps working. Downgrade writes an
empty string where a row has none. See docs/design/format.md.

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
