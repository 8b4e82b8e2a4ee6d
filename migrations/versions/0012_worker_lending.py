"""workers.lending_to: the job a worker runs training ranks for, on another machine's behalf

A job on several machines reserves the other machines' free training workers by writing its
id here (one conditional UPDATE per worker, so two jobs never take the same one), and frees
them when it ends; a reservation whose job is no longer running counts as free.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("lending_to", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("lending_to")
