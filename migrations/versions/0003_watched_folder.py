"""watched folder: document versions and source paths, project inbox and auto-train, job lineage

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("projects") as batch_op:
        batch_op.add_column(sa.Column("inbox_path", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("inbox_status", sa.String(length=200), nullable=True))
        batch_op.add_column(sa.Column("inbox_checked_at", sa.DateTime(), nullable=True))
        batch_op.add_column(sa.Column("last_change_at", sa.DateTime(), nullable=True))
        batch_op.add_column(
            sa.Column("auto_train", sa.String(length=16), server_default="off", nullable=False)
        )
        batch_op.add_column(
            sa.Column("auto_quiet_s", sa.Integer(), server_default=sa.text("600"), nullable=False)
        )
        batch_op.add_column(
            sa.Column(
                "auto_nightly_at", sa.String(length=5), server_default="02:00", nullable=False
            )
        )
        batch_op.add_column(sa.Column("auto_fired_at", sa.DateTime(), nullable=True))
        batch_op.add_column(
            sa.Column("start_from", sa.String(length=8), server_default="latest", nullable=False)
        )
        batch_op.add_column(sa.Column("current_job_id", sa.Integer(), nullable=True))

    with op.batch_alter_table("documents") as batch_op:
        batch_op.add_column(sa.Column("source_path", sa.Text(), nullable=True))
        batch_op.add_column(
            sa.Column("version", sa.Integer(), server_default=sa.text("1"), nullable=False)
        )
        batch_op.add_column(sa.Column("source_mtime_ns", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("last_seen_at", sa.DateTime(), nullable=True))
        batch_op.add_column(sa.Column("retired_at", sa.DateTime(), nullable=True))
        batch_op.add_column(sa.Column("retired_reason", sa.String(length=16), nullable=True))

    with op.batch_alter_table("jobs") as batch_op:
        batch_op.add_column(
            sa.Column("auto", sa.Boolean(), server_default=sa.false(), nullable=False)
        )
        batch_op.add_column(sa.Column("parent_job_id", sa.Integer(), nullable=True))
        batch_op.create_foreign_key(
            batch_op.f("fk_jobs_parent_job_id_jobs"),
            "jobs",
            ["parent_job_id"],
            ["id"],
            ondelete="SET NULL",
        )


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_constraint(batch_op.f("fk_jobs_parent_job_id_jobs"), type_="foreignkey")
        batch_op.drop_column("parent_job_id")
        batch_op.drop_column("auto")

    with op.batch_alter_table("documents") as batch_op:
        for column in (
            "retired_reason",
            "retired_at",
            "last_seen_at",
            "source_mtime_ns",
            "version",
            "source_path",
        ):
            batch_op.drop_column(column)

    with op.batch_alter_table("projects") as batch_op:
        for column in (
            "current_job_id",
            "start_from",
            "auto_fired_at",
            "auto_nightly_at",
            "auto_quiet_s",
            "auto_train",
            "last_change_at",
            "inbox_checked_at",
            "inbox_status",
            "inbox_path",
        ):
            batch_op.drop_column(column)
