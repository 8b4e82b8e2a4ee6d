"""users, sessions, api_tokens, sign_in_links: accounts

Every request now needs a signed-in session or an API token (app/accounts/door.py). Tokens
are stored as SHA-256 hashes, passwords as argon2 hashes.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "users",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("password_hash", sa.String(200), nullable=True),
        sa.Column("role", sa.String(20), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("disabled", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_users")),
        sa.UniqueConstraint("name", name=op.f("uq_users_name")),
    )
    for table, extra in (
        ("sessions", [sa.Column("csrf_token", sa.String(64), nullable=False),
                      sa.Column("created_at", sa.DateTime(), nullable=False),
                      sa.Column("last_seen_at", sa.DateTime(), nullable=False),
                      sa.Column("revoked_at", sa.DateTime(), nullable=True)]),
        ("api_tokens", [sa.Column("label", sa.String(100), nullable=False),
                        sa.Column("created_at", sa.DateTime(), nullable=False),
                        sa.Column("last_used_at", sa.DateTime(), nullable=True),
                        sa.Column("revoked_at", sa.DateTime(), nullable=True)]),
        ("sign_in_links", [sa.Column("created_at", sa.DateTime(), nullable=False),
                           sa.Column("expires_at", sa.DateTime(), nullable=False),
                           sa.Column("used_at", sa.DateTime(), nullable=True)]),
    ):
        op.create_table(
            table,
            sa.Column("id", sa.Integer(), nullable=False),
            sa.Column("token_hash", sa.String(64), nullable=False),
            sa.Column("user_id", sa.Integer(), nullable=table == "sign_in_links"),
            *extra,
            sa.ForeignKeyConstraint(["user_id"], ["users.id"], ondelete="CASCADE",
                                    name=op.f(f"fk_{table}_user_id_users")),
            sa.PrimaryKeyConstraint("id", name=op.f(f"pk_{table}")),
            sa.UniqueConstraint("token_hash", name=op.f(f"uq_{table}_token_hash")),
        )
        op.create_index(op.f(f"ix_{table}_user_id"), table, ["user_id"])


def downgrade() -> None:
    for table in ("sign_in_links", "api_tokens", "sessions"):
        op.drop_index(op.f(f"ix_{table}_user_id"), table_name=table)
        op.drop_table(table)
    op.drop_table("users")
