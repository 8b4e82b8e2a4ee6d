"""workers.chat_stage_of: the chat worker whose model's second stage a worker holds

A chat on two machines (worker/chat/head.py) reserves another machine's free training
worker by writing the chat worker's node name here (one conditional UPDATE), and the worker
clears it when the stage ends (closed, idle, or its chat worker gone); jobs do not take a
worker reserved so.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("chat_stage_of", sa.String(200), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("chat_stage_of")
