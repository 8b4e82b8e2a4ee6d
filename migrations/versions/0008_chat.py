"""conversations, chat_messages, passages: chat with a model version, from the documents

The passages' full-text index is the database's own: on SQLite an FTS5 table
(passages_fts, external content, porter stemming) kept in step by triggers; on PostgreSQL
an expression GIN index on to_tsvector('english', text). Neither is a model table: the
migration test leaves passages_fts* out of its comparison (tests/migrations).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "conversations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=True),
        sa.Column("title", sa.String(200), nullable=False),
        sa.Column("origin", sa.String(8), nullable=False),
        sa.Column("use_documents", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("compare_group", sa.String(32), nullable=True),
        sa.Column("saved_as", sa.String(100), nullable=True),
        sa.Column("token_ids", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"], ondelete="CASCADE",
                                name=op.f("fk_conversations_project_id_projects")),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"], ondelete="CASCADE",
                                name=op.f("fk_conversations_user_id_users")),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE",
                                name=op.f("fk_conversations_job_id_jobs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_conversations")),
        sqlite_autoincrement=True,  # ids never reused: they name Redis streams
    )
    for column in ("project_id", "user_id", "job_id", "compare_group"):
        op.create_index(op.f(f"ix_conversations_{column}"), "conversations", [column])
    op.create_table(
        "chat_messages",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("conversation_id", sa.Integer(), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("content", sa.Text(), nullable=False),
        sa.Column("prompt_content", sa.Text(), nullable=True),
        sa.Column("sources", sa.JSON(), nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("temperature", sa.Float(), nullable=False),
        sa.Column("max_new_tokens", sa.Integer(), nullable=True),
        sa.Column("token_ids", sa.JSON(), nullable=True),
        sa.Column("stats", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=True),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(["conversation_id"], ["conversations.id"], ondelete="CASCADE",
                                name=op.f("fk_chat_messages_conversation_id_conversations")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_chat_messages")),
        sqlite_autoincrement=True,
    )
    op.create_index(op.f("ix_chat_messages_conversation_id"), "chat_messages",
                    ["conversation_id"])
    op.create_table(
        "passages",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("document_id", sa.Integer(), nullable=False),
        sa.Column("ord", sa.Integer(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"], ondelete="CASCADE",
                                name=op.f("fk_passages_project_id_projects")),
        sa.ForeignKeyConstraint(["document_id"], ["documents.id"], ondelete="CASCADE",
                                name=op.f("fk_passages_document_id_documents")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_passages")),
    )
    for column in ("project_id", "document_id"):
        op.create_index(op.f(f"ix_passages_{column}"), "passages", [column])
    if op.get_bind().dialect.name == "sqlite":
        for statement in SQLITE_FTS:
            op.execute(statement)
    else:
        op.execute("CREATE INDEX ix_passages_fts ON passages "
                   "USING gin (to_tsvector('english', text))")


SQLITE_FTS = (
    ("CREATE VIRTUAL TABLE passages_fts USING fts5(text, content='passages', "
     "content_rowid='id', tokenize='porter unicode61')"),
    ("CREATE TRIGGER passages_ai AFTER INSERT ON passages BEGIN "
     "INSERT INTO passages_fts(rowid, text) VALUES (new.id, new.text); END"),
    ("CREATE TRIGGER passages_ad AFTER DELETE ON passages BEGIN "
     "INSERT INTO passages_fts(passages_fts, rowid, text) VALUES ('delete', old.id, old.text); "
     "END"),
    ("CREATE TRIGGER passages_au AFTER UPDATE ON passages BEGIN "
     "INSERT INTO passages_fts(passages_fts, rowid, text) VALUES ('delete', old.id, old.text); "
     "INSERT INTO passages_fts(rowid, text) VALUES (new.id, new.text); END"),
)


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        for name in ("passages_au", "passages_ad", "passages_ai"):
            op.execute(f"DROP TRIGGER IF EXISTS {name}")
        op.execute("DROP TABLE IF EXISTS passages_fts")
    else:
        op.execute("DROP INDEX IF EXISTS ix_passages_fts")
    for column in ("document_id", "project_id"):
        op.drop_index(op.f(f"ix_passages_{column}"), table_name="passages")
    op.drop_table("passages")
    op.drop_index(op.f("ix_chat_messages_conversation_id"), table_name="chat_messages")
    op.drop_table("chat_messages")
    for column in ("compare_group", "job_id", "user_id", "project_id"):
        op.drop_index(op.f(f"ix_conversations_{column}"), table_name="conversations")
    op.drop_table("conversations")
