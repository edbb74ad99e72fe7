"""Each family records the chunk size its members are cut at

Members of a family dedup against each other, and find their delta bases, only if they are cut
alike: a push cut at another size stores every chunk anew. So a family keeps the size of its first
push, and every later push (embedded, or any client through the API) follows it, whatever its own
default or MFSREG_CHUNK_SIZE.

Existing families get the size their members were cut at, read off their stored manifests (the
step of the first tensor cut in several chunks); a family none of whose tensors was cut in two, or
with no version, gets 1 MiB, the default before this release. Rows that processes of the previous
release create during a rolling upgrade get the column's default, 1 MiB; a server then reads each
push's size off its manifest and refuses one cut otherwise than its family.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

PREVIOUS_DEFAULT = 1 << 20


def upgrade() -> None:
    from mfsreg.registry.manifest import Manifest

    with op.batch_alter_table("families") as batch_op:
        batch_op.add_column(sa.Column("chunk_size", sa.Integer(), nullable=False, server_default=str(PREVIOUS_DEFAULT)))
    conn = op.get_bind()
    for (family_id,) in conn.execute(sa.text("SELECT id FROM families")).all():
        version_ids = (
            conn.execute(sa.text("SELECT id FROM versions WHERE family_id = :f ORDER BY id"), {"f": family_id})
            .scalars()
            .all()
        )
        for vid in version_ids:  # usually the first has a tensor cut in two
            data = conn.execute(sa.text("SELECT manifest FROM versions WHERE id = :v"), {"v": vid}).scalar_one()
            size = Manifest.from_bytes(bytes(data)).cut_size()
            if size is not None:
                conn.execute(sa.text("UPDATE families SET chunk_size = :s WHERE id = :f"), {"s": size, "f": family_id})
                break


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        # Batch mode would copy the table, and dropping the old one breaks versions' foreign key;
        # SQLite drops a plain column in place since 3.35.
        op.execute("ALTER TABLE families DROP COLUMN chunk_size")
    else:
        op.drop_column("families", "chunk_size")
