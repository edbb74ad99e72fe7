"""Each family records the chunk size its members are cut at

Existing families get the size read off their stored manifests (the step of the first tensor cut in
several chunks), else 1 MiB, the previous default; rows that processes of the previous release
create during a rolling upgrade get that default too. See docs/design/format.md.

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
    from mfsreg.registry.format.manifest import Manifest

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
