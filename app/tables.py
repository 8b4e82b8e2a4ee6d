"""Every table of the schema, for Alembic and the migration test: the models of app/models.py
(with the accounts' and the audit log's) and the chat's, which build on them."""

from app import models as _models  # noqa: F401
from app.chat import models as _chat_models  # noqa: F401
