"""Folders an admin allows watched folders in (/admin/folders, app/services/allowed_folders.py):
added and removed by an admin only, refused in words where watching would read what it must
not (the whole disk, a home folder, DocTune's own data), and applied at once to the project
form and the project page. Real app, real database, real folders."""

from __future__ import annotations

import html
import os
import re
from pathlib import Path

from sqlalchemy import select

from app.audit import AuditEvent
from app.db import session_scope
from app.main import create_app
from app.models import AllowedFolder, Project
from app.services.inbox import folder_refusal
from app.settings import settings
from tests.app.web import local_client


def _project() -> int:
    with session_scope() as session:
        project = Project(name="Shared handbooks")
        session.add(project)
        session.flush()
        return project.id


def _allowed() -> list[str]:
    with session_scope() as session:
        return list(session.scalars(select(AllowedFolder.path)))


def test_an_admin_allows_a_folder_and_projects_may_watch_in_it_until_removed(env, tmp_path):
    shared = tmp_path / "shared"
    (shared / "handbooks").mkdir(parents=True)
    project_id = _project()
    app = create_app()
    with local_client(app) as admin:
        form = {"inbox_path": str(shared / "handbooks")}
        r = admin.post(f"/projects/{project_id}/inbox", data=form)
        assert r.status_code == 422 and "an admin adds it under Admin, Folders" in r.text

        r = admin.post("/admin/folders", data={"path": str(shared)}, follow_redirects=False)
        assert r.status_code == 303 and _allowed() == [str(shared)]
        page = admin.get("/admin/folders").text
        assert str(shared) in page and "test admin" in page
        r = admin.post(f"/projects/{project_id}/inbox", data=form, follow_redirects=False)
        assert r.status_code == 303
        assert f"or inside {shared}" in admin.get(f"/projects/{project_id}").text

        with session_scope() as session:
            folder_id = session.scalar(select(AllowedFolder.id))
        r = admin.post(f"/admin/folders/{folder_id}/remove", follow_redirects=False)
        assert r.status_code == 303 and _allowed() == []
        # The project keeps its setting, but the folder is not watched any more, and says so.
        page = admin.get(f"/projects/{project_id}").text
        assert "This folder is not watched." in page
        assert admin.post(f"/admin/folders/{folder_id}/remove").status_code == 404
    with session_scope() as session:
        actions = list(session.scalars(select(AuditEvent.action).order_by(AuditEvent.id)))
    assert actions == ["folder_allowed", "folder_settings", "folder_removed"]


def test_folders_that_would_expose_too_much_are_refused_in_words(env, tmp_path):
    inside = tmp_path / "ok"
    inside.mkdir()
    (tmp_path / "to-data").symlink_to(settings.data_dir)
    settings.documents_dir.mkdir(exist_ok=True)
    home = Path.home()
    cases = {
        "": "Enter the folder's full path",
        "relative/folder": "full path",
        str(tmp_path / "missing"): "There is no folder at",
        "/": "The whole disk cannot be allowed",
        str(home): "A whole home folder cannot be allowed",
        "~": "A whole home folder cannot be allowed",
        str(settings.data_dir): "holds DocTune's own data",
        str(settings.data_dir / "documents"): "holds DocTune's own data",
        str(tmp_path / "to-data"): "holds DocTune's own data",  # a link to it, too
        str(settings.data_dir.parent): "holds DocTune's own data",  # a folder above it
        "/tmp/\x00evil": "cannot be used",
    }
    app = create_app()
    with local_client(app) as admin:
        for path, words in cases.items():
            r = admin.post("/admin/folders", data={"path": path})
            assert r.status_code == 422, path
            shown = [html.unescape(m) for m in re.findall(r'field-error[^>]*>([^<]*)', r.text)]
            assert len(shown) == 1 and words in shown[0], (path, shown)
        assert _allowed() == []
        assert admin.post("/admin/folders", data={"path": str(inside)}).status_code == 200
        r = admin.post("/admin/folders", data={"path": str(inside / ".")})
        assert r.status_code == 422 and "may already be watched" in r.text
    assert _allowed() == [str(inside)]


def test_members_and_viewers_cannot_change_the_folders(env, tmp_path):
    app = create_app()
    for role in ("member", "viewer"):
        with local_client(app, role=role) as client:
            assert client.get("/admin/folders").status_code == 403
            assert client.post("/admin/folders", data={"path": str(tmp_path)}).status_code == 403
    assert _allowed() == []


def test_a_watched_folder_never_holds_or_lies_in_the_data_dir(env, tmp_path):
    data = Path(os.path.realpath(settings.data_dir))
    everything = [Path("/")]  # even when a configured folder would allow it
    for folder in (data, data / "documents", data.parent):
        refusal = folder_refusal(folder, settings.inbox_dir, everything)
        assert refusal is not None and "DocTune's own data" in refusal, folder
    assert folder_refusal(tmp_path, settings.inbox_dir, everything) is None
