"""The watched-folder panel of the project page: the folder and its copy button, what the
watcher last reported, and the settings form (folder, auto-train, where training starts)."""

from __future__ import annotations

from datetime import timedelta

from app.db import session_scope, utcnow
from app.models import Project
from app.settings import settings

from .factories import htmx, make_project


def _project(**fields) -> int:
    with session_scope() as session:
        project = make_project(session, "Folder: Q&A / 2024")
        for key, value in fields.items():
            setattr(project, key, value)
        return project.id


def test_the_default_folder_is_shown_with_a_copy_button(client):
    project_id = _project(inbox_status="ok", inbox_checked_at=utcnow())
    page = client.get(f"/projects/{project_id}").text
    folder = settings.inbox_dir / "Folder- Q&A - 2024"  # what a file system accepts
    assert f'<code id="inbox-path">{folder}</code>'.replace("&", "&amp;") in page
    assert 'data-copy="#inbox-path"' in page and "Watching this folder." in page


def test_the_status_reports_a_missing_folder_and_a_stopped_watcher(client):
    missing = "The folder /media/usb/inbox is missing: it was deleted or renamed."
    project_id = _project(inbox_status=missing, inbox_checked_at=utcnow())
    fragment = client.get(f"/projects/{project_id}", headers=htmx("inbox-status")).text
    assert fragment.lstrip().startswith('<div id="inbox-status"')
    assert missing in fragment and 'role="alert"' in fragment and "<h1>" not in fragment
    with session_scope() as session:
        session.get(Project, project_id).inbox_checked_at = utcnow() - timedelta(minutes=10)
    fragment = client.get(f"/projects/{project_id}", headers=htmx("inbox-status")).text
    assert "The folder watcher is not running" in fragment


def test_the_settings_form_saves_and_explains_mistakes(client, tmp_path, monkeypatch):
    monkeypatch.setattr(settings, "allowed_folders", [tmp_path])  # DOCTUNE_ALLOWED_FOLDERS
    project_id = _project()
    r = client.post(
        f"/projects/{project_id}/inbox",
        data={"inbox_path": str(tmp_path), "auto_train": "changes", "auto_quiet_min": "15",
              "auto_nightly_at": "03:00", "start_from": "base"},
        follow_redirects=False,
    )
    assert r.status_code == 303
    with session_scope() as session:
        project = session.get(Project, project_id)
        assert (project.inbox_path, project.auto_train, project.auto_quiet_s,
                project.start_from) == (str(tmp_path), "changes", 900, "base")
    page = client.get(f"/projects/{project_id}").text
    assert f'<code id="inbox-path">{tmp_path}</code>' in page
    r = client.post(f"/projects/{project_id}/inbox",
                    data={"inbox_path": "relative", "auto_quiet_min": "soon"})
    assert r.status_code == 422
    assert "full path" in r.text and "number of minutes" in r.text
    assert 'value="relative"' in r.text  # what was typed stays in the form


def test_a_folder_outside_the_allowed_ones_is_refused_on_the_form(client, tmp_path, monkeypatch):
    allowed = tmp_path / "shared"
    allowed.mkdir()
    (allowed / "to-home").symlink_to(tmp_path)
    monkeypatch.setattr(settings, "allowed_folders", [allowed])
    project_id = _project()
    page = client.get(f"/projects/{project_id}").text
    assert f"inside {settings.inbox_dir} or inside {allowed}." in page  # the form's hint
    for wanted in ("~", "/", "/etc", str(tmp_path), str(allowed / "to-home" / "docs")):
        r = client.post(f"/projects/{project_id}/inbox", data={"inbox_path": wanted})
        assert r.status_code == 422, wanted
        assert "DocTune only watches folders inside" in r.text
        assert "an admin adds it under Admin, Folders" in r.text
    assert f"(it leads to {tmp_path / 'docs'})" in r.text
    with session_scope() as session:
        assert session.get(Project, project_id).inbox_path is None
    for fine in (allowed / "team", settings.inbox_dir / "elsewhere"):
        r = client.post(f"/projects/{project_id}/inbox", data={"inbox_path": str(fine)},
                        follow_redirects=False)
        assert r.status_code == 303, r.text
    # A folder set before it stopped qualifying (or written behind the form's back): the
    # page says it is not watched, and why, whatever the watcher last reported.
    with session_scope() as session:
        project = session.get(Project, project_id)
        project.inbox_path, project.inbox_status = "/etc", "ok"
        project.inbox_checked_at = utcnow()
    page = client.get(f"/projects/{project_id}").text
    assert "This folder is not watched." in page and "Watching this folder." not in page
