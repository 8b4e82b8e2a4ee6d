"""The main machine marks its data folder with its database's id and the folder's path
(app/instance.py) whenever it migrates, so a joining machine can check it mounted the right
folder at the right place (tests/worker/cli/test_join.py)."""

from __future__ import annotations

from app.db import session_scope
from app.instance import FolderMark, claim_data_dir, database_instance_id, mark_data_dir, read_mark
from app.migrate import upgrade_to_head
from app.settings import settings


def test_migrating_marks_the_data_folder_with_the_databases_id(env):
    upgrade_to_head()
    with session_scope() as session:
        instance_id = database_instance_id(session)
    assert len(instance_id) == 36  # a uuid, made by migration 0011
    assert read_mark(settings.data_dir) == FolderMark(instance_id, str(settings.data_dir))

    # A folder that held another database's id (that database deleted, say) takes this one.
    mark_data_dir(settings.data_dir, "another-doctune")
    claim_data_dir()
    assert read_mark(settings.data_dir).instance_id == instance_id
