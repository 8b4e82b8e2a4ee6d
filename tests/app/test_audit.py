"""The audit log (app/audit.py, /admin/audit): what people do is recorded by name, in order, in
the same transaction as the change; a refused change leaves no entry; only an admin reads
the log, and its CSV export keeps hostile file names as text. Real app, real database."""

from __future__ import annotations

import csv
import io
import re

from fastapi.testclient import TestClient
from sqlalchemy import select

from app.accounts import service
from app.audit import AuditEvent
from app.db import session_scope
from app.main import create_app
from app.models import JobState, Project
from tests.app.web import local_client, local_url

from .factories import make_document, make_job, write_artifact

PASSWORD = "correct horse battery"


def _events() -> list[tuple[str, str, str, str]]:
    with session_scope() as session:
        rows = session.scalars(select(AuditEvent).order_by(AuditEvent.id))
        return [(e.actor, e.action, e.subject, e.detail) for e in rows]


def _csrf(html: str) -> str:
    return re.search(r'<meta name="csrf-token" content="([^"]+)">', html).group(1)


def _signed_in_as(app, name: str, role: str) -> TestClient:
    """A browser-like client that signs in through /signin with a password."""
    with session_scope() as session:
        service.create_user(session, name, role, PASSWORD)
    client = TestClient(app, base_url=local_url(), headers={"Origin": local_url()})
    r = client.post("/signin", data={"name": name, "password": PASSWORD},
                    follow_redirects=False)
    assert r.status_code == 303
    client.headers["X-CSRF-Token"] = _csrf(client.get("/").text)
    return client


def test_what_people_do_is_recorded_by_name_in_order(env):
    app = create_app()
    anonymous = TestClient(app, base_url=local_url(), headers={"Origin": local_url()})
    with session_scope() as session:
        service.create_user(session, "Bob", "member", PASSWORD)
    assert anonymous.post("/signin", data={"name": "Bob", "password": "guess"}).status_code == 401
    r = anonymous.post("/signin", data={"name": "Bob", "password": PASSWORD},
                       follow_redirects=False)
    assert r.status_code == 303
    bob = anonymous
    bob.headers["X-CSRF-Token"] = _csrf(bob.get("/").text)

    assert bob.post("/projects", data={"name": "Handbook"}, follow_redirects=False).is_redirect
    with session_scope() as session:
        project_id = session.scalar(select(Project.id).where(Project.name == "Handbook"))
    files = [("files", ("leave.txt", b"Annual leave is 25 days.")),
             ("files", ("=HYPERLINK(1).txt", b"A name a spreadsheet would run."))]
    assert bob.post(f"/projects/{project_id}/documents", files=files).status_code == 200
    # Training cannot start while the two are being read: refused, so not in the log.
    assert bob.post(f"/projects/{project_id}/jobs", data={"method": "lora"}).status_code == 422
    with session_scope() as session:
        project = session.get(Project, project_id)
        for doc in project.documents:
            doc.status = "extracted"
            doc.word_count = 5
        done = make_job(session, project, JobState.done)
        queued = make_job(session, project, JobState.queued)
        done_id, queued_id = done.id, queued.id
    path = write_artifact(env.data_dir, done_id, "adapter", size=4096)
    with session_scope() as session:
        session.get(type(done), done_id).artifacts = {"adapter": str(path)}
    r = bob.post(f"/projects/{project_id}/jobs", data={"method": "lora"}, follow_redirects=False)
    assert r.status_code == 303
    new_job = int(r.headers["location"].rsplit("/", 1)[1])
    assert bob.post(f"/jobs/{queued_id}/cancel", follow_redirects=False).is_redirect
    assert bob.get(f"/jobs/{done_id}/download/adapter").status_code == 200
    assert bob.get(f"/jobs/{done_id}/download/merged").status_code == 404  # not made: no entry
    assert bob.post("/signout", follow_redirects=False).is_redirect

    handbook = "project “Handbook”"
    assert _events() == [
        ("someone signed out", "sign_in_refused", "name “Bob”", ""),
        ("Bob", "signed_in", "", ""),
        ("Bob", "project_created", handbook, ""),
        ("Bob", "uploaded", handbook, "leave.txt, =HYPERLINK(1).txt"),
        ("Bob", "training_started", handbook, f"job {new_job}, lora"),
        ("Bob", "job_cancelled", f"job {queued_id}", handbook),
        ("Bob", "downloaded", f"job {done_id}", f"LoRA adapter (.zip), {handbook}"),
        ("Bob", "signed_out", "", ""),
    ]
    with session_scope() as session:
        addresses = set(session.scalars(select(AuditEvent.address)))
    assert addresses == {"testclient"}  # the client address Starlette's test client reports


def test_only_an_admin_reads_the_log_and_the_export_keeps_names_as_text(env):
    app = create_app()
    member = _signed_in_as(app, "Bob", "member")
    with session_scope() as session:
        project = session.scalar(select(Project).where(Project.name == "x")) or Project(name="x")
        session.add(project)
        session.flush()
        make_document(session, project)
        project_id = project.id
    files = [("files", ("=cmd|'-C calc'!A0.txt", b"hostile name"))]
    assert member.post(f"/projects/{project_id}/documents", files=files).status_code == 200
    for path in ("/admin/audit", "/admin/audit.csv"):
        assert member.get(path).status_code == 403

    with local_client(app) as admin:  # an admin account made by the test helper
        page = admin.get("/admin/audit")
        assert page.status_code == 200
        assert "Uploaded documents" in page.text and "Bob" in page.text
        assert "=cmd|&#39;-C calc&#39;!A0.txt" in page.text  # escaped, shown as typed
        only_sign_ins = admin.get("/admin/audit", params={"action": "signed_in"}).text
        assert 'class="audit-signed_in"' in only_sign_ins
        assert 'class="audit-uploaded"' not in only_sign_ins
        export = admin.get("/admin/audit.csv")
    assert export.headers["content-type"].startswith("text/csv")
    assert "attachment" in export.headers["content-disposition"]
    rows = list(csv.reader(io.StringIO(export.text)))
    assert rows[0] == ["time (UTC)", "who", "what", "subject", "detail", "address"]
    upload = next(r for r in rows if r[2] == "Uploaded documents")
    assert upload[1] == "Bob" and upload[4] == "'=cmd|'-C calc'!A0.txt"  # not a formula


def test_the_log_pages_back_through_older_events(env):
    app = create_app()
    with session_scope() as session:
        from app import audit
        for i in range(120):
            audit.record(session, audit.Action.signed_in, actor=f"person {i:03d}")
    with local_client(app) as admin:
        first = admin.get("/admin/audit").text
        assert "person 119" in first and "person 070" in first and "person 069" not in first
        older = re.search(r'<a href="(/admin/audit\?before=\d+)">Older events</a>', first)
        second = admin.get(older.group(1).replace("&amp;", "&")).text
        assert "person 069" in second and "person 070" not in second
        assert admin.get("/admin/audit", params={"before": "x", "user": "-1"}).status_code == 200
