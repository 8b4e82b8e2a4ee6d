"""workers, instance: the worker registry and this DocTune's id

Each Celery worker registers itself in `workers` (its machine, queues, hardware, heartbeat);
`instance` holds one id, made here, that the main machine also writes into its data folder,
so a worker joining from another machine can check it mounted the right folder.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01
"""

import uuid
from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "workers",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("node", sa.String(200), nullable=False),
        sa.Column("host", sa.String(200), nullable=False),
        sa.Column("queues", sa.JSON(), nullable=False),
        sa.Column("hardware", sa.JSON(), nullable=False),
        sa.Column("version", sa.String(40), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(), nullable=False),
        sa.Column("stopped_at", sa.DateTime(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_workers")),
        sa.UniqueConstraint("node", name=op.f("uq_workers_node")),
    )
    instance = op.create_table(
        "instance",
        sa.Column("id", sa.String(36), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_instance")),
    )
    op.bulk_insert(instance, [{"id": str(uuid.uuid4()),
                               "created_at": datetime.now(UTC).replace(tzinfo=None)}])


def downgrade() -> None:
    op.drop_table("instance")
    op.drop_table("workers")
