"""An index on chunks.pack_id

Prune asks which chunk rows point into each pack it retires or repacks (db/reclaim.chunks_in,
retire_packs), and Postgres checks the foreign key from chunks to packs on each DELETE FROM packs:
without an index each of those scans every chunk row, once per pack, so a prune of a large
registry took time in the number of packs times the number of chunks.

Revision ID: 0009
Revises: 0008
"""

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("chunks") as batch_op:
        batch_op.create_index(batch_op.f("ix_chunks_pack_id"), ["pack_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("chunks") as batch_op:
        batch_op.drop_index(batch_op.f("ix_chunks_pack_id"))
