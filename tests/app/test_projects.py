"""Creating and listing projects."""

from __future__ import annotations

from sqlalchemy import select

from app.db import session_scope
from app.models import Project


def _project_names() -> list[str]:
    with session_scope() as session:
        return list(session.scalars(select(Project.name).order_by(Project.id)))


def test_create_project_trims_the_name_and_redirects_to_it(client):
    r = client.post("/projects", data={"name": "   Support   FAQ  "}, follow_redirects=False)
    assert r.status_code == 303
    assert _project_names() == ["Support FAQ"]
    page = client.get(r.headers["location"])
    assert page.status_code == 200
    assert "<h1>Support FAQ</h1>" in page.text
    assert 'href="/projects/' in client.get("/").text


def test_empty_name_is_refused_with_a_message(client):
    for name in ("", "    ", "\t\n"):
        r = client.post("/projects", data={"name": name})
        assert r.status_code == 422
        assert "Please give the project a name." in r.text
    assert _project_names() == []


def test_duplicate_name_is_refused_ignoring_case(client):
    assert (
        client.post("/projects", data={"name": "HR handbook"}, follow_redirects=False).status_code
        == 303
    )
    r = client.post("/projects", data={"name": "  hr HANDBOOK "})
    assert r.status_code == 422
    assert "There is already a project called “HR handbook”" in r.text
    assert 'value="  hr HANDBOOK "' in r.text  # the form keeps what was typed
    assert _project_names() == ["HR handbook"]


def test_name_length_limit_is_100_characters(client):
    assert (
        client.post("/projects", data={"name": "x" * 100}, follow_redirects=False).status_code
        == 303
    )
    r = client.post("/projects", data={"name": "y" * 101})
    assert r.status_code == 422
    assert "please keep it to 100" in r.text
    assert _project_names() == ["x" * 100]


def test_control_characters_in_a_name_are_refused(client):
    r = client.post("/projects", data={"name": "Sales\u202eevil"})
    assert r.status_code == 422
    assert "invisible control characters" in r.text


def test_names_are_escaped_on_the_pages(client):
    r = client.post("/projects", data={"name": "<script>alert(1)</script>"}, follow_redirects=False)
    assert r.status_code == 303
    for url in ("/", r.headers["location"]):
        text = client.get(url).text
        assert "<script>alert(1)</script>" not in text
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text


def test_unknown_project_is_a_clear_404(client):
    r = client.get("/projects/999")
    assert r.status_code == 404
    assert "There is no project number 999" in r.text
    assert client.get("/projects/not-a-number").status_code == 404


def test_what_a_reader_skipped_is_shown_beside_the_document(client):
    from app.db import session_scope

    from .factories import make_document, make_project

    with session_scope() as session:
        project = make_project(session, "Notes")
        doc = make_document(session, project, "faq.csv", qa_count=3)
        doc.read_notes = ["Skipped 2 rows with an empty question or answer.", "<b>odd</b>"]
        project_id = project.id
    page = client.get(f"/projects/{project_id}").text
    assert "Skipped 2 rows with an empty question or answer." in page
    assert "&lt;b&gt;odd&lt;/b&gt;" in page and "<b>odd</b>" not in page
