"""App-wide behaviour: static files, errors, commit timing, same-origin posts, boundaries."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from sqlalchemy import select

from app.db import SessionDep, session_scope
from app.main import create_app
from app.models import Project
from tests.app.web import local_client, local_url

ROOT = Path(__file__).resolve().parents[2]


def test_static_files_and_vendored_htmx(client):
    r = client.get("/static/htmx.min.js")
    assert r.status_code == 200 and "htmx" in r.text[:200]
    assert client.get("/static/doctune.css").status_code == 200
    page = client.get("/").text
    assert 'src="/static/htmx.min.js' in page and 'href="/static/doctune.css' in page


def test_unknown_page_is_a_friendly_404(client):
    r = client.get("/no/such/page")
    assert r.status_code == 404
    assert "There is no page at this address." in r.text and "<html" in r.text


HUGE = "9" * 20  # past any id column (SQLite's and PostgreSQL's drivers raise, not miss)


def test_an_id_past_what_the_database_holds_is_not_found_not_a_crash(client, env):
    with session_scope() as session:
        project = Project(name="Manuals")
        session.add(project)
        session.flush()
        project_id = project.id
    for path in (f"/projects/{HUGE}", f"/jobs/{HUGE}", f"/chat/{HUGE}", f"/api/jobs/{HUGE}",
                 f"/api/projects/{HUGE}", f"/jobs/{HUGE}/download/adapter",
                 f"/chat/replies/{HUGE}", f"/chat/replies/{HUGE}/events", "/projects/0"):
        r = client.get(path)
        assert r.status_code == 404, (path, r.status_code)
    for path in (f"/jobs/{HUGE}/cancel", f"/account/tokens/{HUGE}/revoke",
                 f"/chat/{HUGE}/delete", f"/admin/users/{HUGE}"):
        r = client.post(path, data={"role": "member"})
        assert r.status_code == 404, (path, r.status_code)
    r = client.get(f"/projects/{project_id}/compare", params={"a": HUGE, "b": "1"})
    assert r.status_code == 422 and "Choose two finished training jobs" in r.text
    r = client.post(f"/projects/{project_id}/chat/read", data={"document_id": HUGE})
    assert r.status_code == 422
    r = client.get("/admin/audit", params={"user": HUGE, "before": HUGE})
    assert r.status_code == 200  # an id that names no row filters nothing, as a word would


def test_a_failed_commit_is_reported_to_the_client(env):
    """The session commits before the response is sent: a redirect never points at a row
    that is not there, and a commit that fails is an error page, not a silent success."""
    app = create_app()

    @app.post("/test-only/duplicate-project")
    def _make_duplicate(session: SessionDep) -> dict:
        session.add(Project(name="Twin"))
        return {"ok": True}  # the unique name clashes only at commit

    with session_scope() as session:
        session.add(Project(name="Twin"))
    with local_client(app, raise_server_exceptions=False) as client:
        r = client.post("/test-only/duplicate-project")
    assert r.status_code == 500
    assert "unexpected problem" in r.text and "Traceback" not in r.text
    with session_scope() as session:
        assert list(session.scalars(select(Project.name))) == ["Twin"]


def test_posts_from_other_sites_are_refused(client):
    r = client.post("/projects", data={"name": "Evil"}, headers={"Origin": "https://evil.example"})
    assert r.status_code == 403
    with session_scope() as session:
        assert list(session.scalars(select(Project))) == []
    same = client.post(
        "/projects",
        data={"name": "Fine"},
        headers={"Origin": local_url()},
        follow_redirects=False,
    )
    assert same.status_code == 303


def test_the_app_never_imports_the_ml_side():
    code = (
        "import sys, app.main\n"
        "ml = ('torch', 'transformers', 'peft', 'worker', 'offload')\n"
        "bad = [m for m in ml if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
