"""Tags and version metadata

versions.description, versions.labels (a JSON object of strings) and versions.pushed_by (a token's
prefix and description, or local:<user>). tags: movable names for versions, one namespace with
the family's version names. tag_events: every move of a tag (who, when, from, to).

Revision ID: 0012
Revises: 0011
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("versions") as batch_op:
        batch_op.add_column(sa.Column("description", sa.String(length=1024), server_default="", nullable=False))
        batch_op.add_column(sa.Column("labels", sa.Text(), server_default="{}", nullable=False))
        batch_op.add_column(sa.Column("pushed_by", sa.String(length=160), server_default="", nullable=False))
    op.create_table(
        "tags",
        sa.Column("family_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("version_id", sa.Integer(), nullable=False),
        sa.Column("set_by", sa.String(length=160), server_default="", nullable=False),
        sa.Column("set_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.ForeignKeyConstraint(["family_id"], ["families.id"], name=op.f("fk_tags_family_id_families")),
        sa.ForeignKeyConstraint(["version_id"], ["versions.id"], name=op.f("fk_tags_version_id_versions")),
        sa.PrimaryKeyConstraint("family_id", "name", name=op.f("pk_tags")),
    )
    op.create_index(op.f("ix_tags_version_id"), "tags", ["version_id"], unique=False)
    op.create_table(
        "tag_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("family_id", sa.Integer(), nullable=False),
        sa.Column("tag", sa.String(length=128), nullable=False),
        sa.Column("from_version", sa.String(length=128), nullable=True),
        sa.Column("to_version", sa.String(length=128), nullable=True),
        sa.Column("actor", sa.String(length=160), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.ForeignKeyConstraint(["family_id"], ["families.id"], name=op.f("fk_tag_events_family_id_families")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tag_events")),
    )
    op.create_index(op.f("ix_tag_events_family_id"), "tag_events", ["family_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_tag_events_family_id"), table_name="tag_events")
    op.drop_table("tag_events")
    op.drop_index(op.f("ix_tags_version_id"), table_name="tags")
    op.drop_table("tags")
    with op.batch_alter_table("versions") as batch_op:
        batch_op.drop_column("pushed_by")
        batch_op.drop_column("labels")
        batch_op.drop_column("description")
