"""Token expiry and last use; the audit log

tokens.expires_at: a token is refused after it (null: never); tokens.last_used_at: when a request
last presented it (kept to the minute). audit_log: who did what (deletes, prunes, quorum changes,
token creation and revocation), and when.

Revision ID: 0011
Revises: 0010
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tokens") as batch_op:
        batch_op.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True))
    op.create_table(
        "audit_log",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.Column("actor", sa.String(length=64), nullable=False),
        sa.Column("action", sa.String(length=32), nullable=False),
        sa.Column("family", sa.String(length=128), nullable=True),
        sa.Column("detail", sa.String(length=1024), server_default="", nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_log")),
    )
    op.create_index(op.f("ix_audit_log_at"), "audit_log", ["at"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_audit_log_at"), table_name="audit_log")
    op.drop_table("audit_log")
    with op.batch_alter_table("tokens") as batch_op:
        batch_op.drop_column("last_used_at")
        batch_op.drop_column("expires_at")
