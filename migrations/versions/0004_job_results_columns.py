"""jobs.dataset, jobs.metrics, jobs.export_errors: out of jobs.scores, which keeps scores only

The worker used to write a finished job's dataset stats, training figures and export errors
into `scores` next to "before" and "after"; each now has a column of its own. Upgrading moves
the keys of existing rows out of `scores` into the new columns; downgrading moves them back.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

MOVED = ("dataset", "metrics", "export_errors")

# The table as this migration sees it (not app.models: that is the schema of today).
_jobs = sa.table(
    "jobs",
    sa.column("id", sa.Integer()),
    sa.column("scores", sa.JSON()),
    *(sa.column(name, sa.JSON()) for name in MOVED),
)


def _rows(connection, columns) -> list:
    return connection.execute(sa.select(_jobs.c.id, *columns).order_by(_jobs.c.id)).all()


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        for name in MOVED:
            batch_op.add_column(sa.Column(name, sa.JSON(), nullable=True))
    connection = op.get_bind()
    for job_id, scores in _rows(connection, [_jobs.c.scores]):
        if not isinstance(scores, dict) or not any(k in scores for k in MOVED):
            continue
        values = {k: scores[k] for k in MOVED if k in scores}
        kept = {k: v for k, v in scores.items() if k not in MOVED}
        connection.execute(
            sa.update(_jobs).where(_jobs.c.id == job_id).values(scores=kept, **values)
        )


def downgrade() -> None:
    connection = op.get_bind()
    columns = [getattr(_jobs.c, name) for name in MOVED]
    for job_id, scores, *moved in _rows(connection, [_jobs.c.scores, *columns]):
        values = {k: v for k, v in zip(MOVED, moved, strict=True) if v is not None}
        if not values:
            continue
        merged = (scores if isinstance(scores, dict) else {}) | values
        connection.execute(sa.update(_jobs).where(_jobs.c.id == job_id).values(scores=merged))
    with op.batch_alter_table("jobs") as batch_op:
        for name in reversed(MOVED):
            batch_op.drop_column(name)
