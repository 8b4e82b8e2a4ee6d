"""documents.read_attempts, documents.read_started_at: a file is read once

A document whose reader (or its worker) died was delivered again and again and stayed
pending. The ingest task now counts its attempts on the row: a redelivered task that finds
one marks the document failed in words instead of reading it again. Existing rows start at 0.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("documents") as batch_op:
        batch_op.add_column(
            sa.Column("read_attempts", sa.Integer(), nullable=False, server_default=sa.text("0"))
        )
        batch_op.add_column(sa.Column("read_started_at", sa.DateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("documents") as batch_op:
        batch_op.drop_column("read_started_at")
        batch_op.drop_column("read_attempts")
