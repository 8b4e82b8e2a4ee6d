"""audit_events, allowed_folders, documents.read_notes

The audit log (app/audit.py) records who signed in, uploaded, trained, downloaded and changed
settings; allowed_folders holds the folders an admin allows watched folders in; a document's
read_notes say what its reader skipped.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "audit_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(), nullable=False),
        sa.Column("user_id", sa.Integer(), nullable=True),
        sa.Column("actor", sa.String(100), nullable=False),
        sa.Column("action", sa.String(40), nullable=False),
        sa.Column("subject", sa.String(200), nullable=False),
        sa.Column("detail", sa.String(1000), nullable=False),
        sa.Column("address", sa.String(64), nullable=True),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"], ondelete="SET NULL",
                                name=op.f("fk_audit_events_user_id_users")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_events")),
    )
    for column in ("at", "user_id", "action"):
        op.create_index(op.f(f"ix_audit_events_{column}"), "audit_events", [column])
    op.create_table(
        "allowed_folders",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("path", sa.String(1000), nullable=False),
        sa.Column("added_by", sa.String(100), nullable=False),
        sa.Column("added_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_allowed_folders")),
        sa.UniqueConstraint("path", name=op.f("uq_allowed_folders_path")),
    )
    with op.batch_alter_table("documents") as batch:
        batch.add_column(sa.Column("read_notes", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("documents") as batch:
        batch.drop_column("read_notes")
    op.drop_table("allowed_folders")
    for column in ("action", "user_id", "at"):
        op.drop_index(op.f(f"ix_audit_events_{column}"), table_name="audit_events")
    op.drop_table("audit_events")
