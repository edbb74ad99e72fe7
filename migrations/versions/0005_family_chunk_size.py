"""Each family records the chunk size its members are cut at

Members of a family dedup against each other, and find their delta bases, only if they are cut
alike: a push cut at another size stores every chunk anew. So a family keeps the size of its first
push, and every later push (embedded, or any client through the API) follows it, whatever its own
default or MFSREG_CHUNK_SIZE.

Existing families were cut at the previous release's default, 1 MiB, unless the operator set
MFSREG_CHUNK_SIZE: run the upgrade with the same environment as the server (as `mfsreg db upgrade`
is), and that size is recorded instead. Processes of the previous release, still running during a
rolling upgrade, create families without the column: they get its default, 1 MiB, which is what
they cut at.

Revision ID: 0005
Revises: 0004
"""
import os

from alembic import op
import sqlalchemy as sa

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("families") as batch_op:
        batch_op.add_column(sa.Column("chunk_size", sa.Integer(), nullable=False, server_default=str(1 << 20)))
    if os.environ.get("MFSREG_CHUNK_SIZE"):
        from registry.config import Settings

        size = Settings.from_env().chunk_size  # the same parsing and range checks as the server's
        op.execute(sa.text("UPDATE families SET chunk_size = :size").bindparams(size=size))


def downgrade() -> None:
    with op.batch_alter_table("families") as batch_op:
        batch_op.drop_column("chunk_size")
