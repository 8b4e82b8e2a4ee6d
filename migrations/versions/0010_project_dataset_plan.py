"""projects.dataset_plan: the training work its documents make, for the Train panel

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


# Plain ALTER TABLE (SQLite has dropped columns since 3.35): a batch migration would copy
# and drop the projects table, and dropping it deletes every job and document with it
# (ON DELETE CASCADE).
def upgrade() -> None:
    op.add_column("projects", sa.Column("dataset_plan", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("projects", "dataset_plan")
