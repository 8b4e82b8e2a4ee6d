"""The front door (app/front_door.py): Host allow-list, Origin on unsafe methods, request size,
free disk space, and the security headers on every response. Real app, real database; each
refusal is checked for its status, its words and for having changed nothing."""

from __future__ import annotations

import json
import re

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from starlette.websockets import WebSocketDisconnect

from app.db import session_scope
from app.main import create_app
from app.models import Job, JobState, Project
from app.settings import settings
from tests.app.web import local_client, local_url, signed_in_headers

from .factories import htmx, make_project, multipart

SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'; "
        "object-src 'none'"
    ),
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "same-origin",
}


def _projects() -> list[str]:
    with session_scope() as session:
        return list(session.scalars(select(Project.name)))


def _bare_client(**kwargs) -> TestClient:
    """A client on the app's own address that sends no Origin unless a test gives one
    (signed in as an admin: the accounts door comes after the front door)."""
    return TestClient(create_app(), base_url=local_url(), headers=signed_in_headers(), **kwargs)


def _assert_secure_headers(response) -> None:
    for name, value in SECURITY_HEADERS.items():
        assert response.headers.get(name) == value, (name, response.status_code)


# Host ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "host",
    ["evil.test", f"evil.test:{settings.port}", f"127.0.0.1.evil.test:{settings.port}",
     "127.0.0.1:1", f"localhost:{settings.port + 1}", f"[::2]:{settings.port}",
     f"evil.test@127.0.0.1:{settings.port}", "127.0.0.1:80a", ""],
)
def test_a_foreign_host_is_refused_in_words(env, host):
    with _bare_client() as client:
        page = client.get("/", headers={"Host": host})
        api = client.get("/api/projects", headers={"Host": host})
        post = client.post("/projects", data={"name": "Rebound"},
                           headers={"Host": host, "Origin": f"http://{host}"})
    assert page.status_code == 400 and "<html" in page.text
    assert "DocTune does not answer to the address" in page.text
    assert f"Open it at {local_url()}/" in page.text and "DOCTUNE_ALLOWED_HOSTS" in page.text
    assert api.status_code == 400 and "does not answer" in api.json()["detail"]
    assert post.status_code == 400  # Host and Origin agreeing (DNS rebinding) proves nothing
    assert _projects() == []
    _assert_secure_headers(page)
    _assert_secure_headers(api)


@pytest.mark.parametrize(
    "host", ["127.0.0.1", f"127.0.0.1:{settings.port}", f"localhost:{settings.port}",
             f"LocalHost:{settings.port}", f"[::1]:{settings.port}", "[::1]"],
)
def test_loopback_names_on_the_configured_port_are_served(env, host):
    with _bare_client() as client:
        r = client.get("/api/projects", headers={"Host": host})
    assert r.status_code == 200 and r.json() == []
    _assert_secure_headers(r)


def test_a_name_configured_for_the_lan_is_served_and_may_post(env):
    lan = f"doctune.lan:{settings.port}"
    with _bare_client() as client:
        assert client.get("/", headers={"Host": lan}).status_code == 400
    settings.allowed_hosts = "Doctune.LAN, 192.168.1.20"
    with _bare_client() as client:
        assert client.get("/", headers={"Host": lan}).status_code == 200
        assert client.get("/", headers={"Host": "192.168.1.20"}).status_code == 200
        ok = client.post("/projects", data={"name": "From the LAN"}, follow_redirects=False,
                         headers={"Host": lan, "Origin": f"http://{lan}"})
        assert ok.status_code == 303
        other = client.post("/projects", data={"name": "Elsewhere"},
                            headers={"Host": lan, "Origin": "http://doctune.lan.evil.test"})
        assert other.status_code == 403
    assert _projects() == ["From the LAN"]


def test_a_server_started_on_another_port_says_which_setting_to_change(env):
    other = settings.port + 7
    with TestClient(create_app(), base_url=f"http://127.0.0.1:{other}") as client:
        r = client.get("/")
    assert r.status_code == 400
    assert f"listens on port {other} but DOCTUNE_PORT is {settings.port}" in r.text


def test_a_malformed_allowed_hosts_setting_stops_the_app(env):
    settings.allowed_hosts = "doctune.lan:9000"
    with pytest.raises(ValueError, match="DOCTUNE_ALLOWED_HOSTS"):
        create_app()


# Origin ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "origin",
    ["https://evil.example", "null", f"http://127.0.0.1:{settings.port + 1}",
     f"https://127.0.0.1:{settings.port}", "http://127.0.0.1", f"http://evil.test:{settings.port}",
     f"http://127.0.0.1:{settings.port}/path", "127.0.0.1"],
)
def test_a_foreign_origin_is_refused_and_changes_nothing(env, origin):
    with session_scope() as session:
        project = make_project(session, "Kept")
        job = Job(project_id=project.id, state=JobState.queued, method="lora", params={})
        session.add(job)
        session.flush()
        job_id, project_id = job.id, project.id
    with _bare_client() as client:
        created = client.post("/projects", data={"name": "Evil"}, headers={"Origin": origin})
        cancel = client.post(f"/jobs/{job_id}/cancel", headers={"Origin": origin, **htmx()})
        train = client.post(f"/projects/{project_id}/jobs", headers={"Origin": origin})
    for r in (created, cancel, train):
        assert r.status_code == 403
        assert "Requests from other web sites are not accepted" in r.text
        _assert_secure_headers(r)
    assert "<html" in created.text and "<html" not in cancel.text  # htmx gets just the note
    assert _projects() == ["Kept"]
    with session_scope() as session:
        assert session.get(Job, job_id).state == JobState.queued
        assert len(session.scalars(select(Job)).all()) == 1


def test_a_post_without_origin_is_refused_unless_the_browser_says_same_origin(env):
    with _bare_client() as client:
        bare = client.post("/projects", data={"name": "Anonymous"})
        cross = client.post("/projects", data={"name": "Cross"},
                            headers={"Sec-Fetch-Site": "cross-site"})
        none = client.post("/projects", data={"name": "Typed"}, headers={"Sec-Fetch-Site": "none"})
        same = client.post("/projects", data={"name": "Same"}, follow_redirects=False,
                           headers={"Sec-Fetch-Site": "same-origin"})
    for r in (bare, cross, none):
        assert r.status_code == 403
        assert "did not say where it came from" in r.text
        assert f"Origin: {local_url()}" in r.text  # what a script must send
    assert same.status_code == 303
    assert _projects() == ["Same"]


def test_safe_methods_need_no_origin(env):
    with _bare_client() as client:
        assert client.get("/").status_code == 200
        assert client.head("/api/projects").status_code in (200, 405)
        assert client.get("/api/projects", headers={"Origin": "https://evil.example"}).json() == []


def test_websockets_are_refused(env):
    with _bare_client() as client, pytest.raises(WebSocketDisconnect), \
            client.websocket_connect("/") as ws:
        ws.receive_text()


# Headers ---------------------------------------------------------------------------------------

def test_security_headers_on_pages_api_static_and_errors(env):
    app = create_app()

    @app.get("/test-only/crash")
    def _crash() -> None:
        raise RuntimeError("boom")

    with local_client(app, raise_server_exceptions=False) as client:
        responses = {
            "page": client.get("/"),
            "api": client.get("/api/projects"),
            "static": client.get("/static/doctune.js"),
            "404": client.get("/no/such/page"),
            "api 404": client.get("/api/projects/999999"),
            "500": client.get("/test-only/crash"),
            "403": client.post("/projects", data={"name": "x"}, headers={"Origin": "null"}),
        }
    assert {k: r.status_code for k, r in responses.items()} == {
        "page": 200, "api": 200, "static": 200, "404": 404, "api 404": 404, "500": 500,
        "403": 403,
    }
    for r in responses.values():
        _assert_secure_headers(r)


def test_pages_have_no_inline_script_and_htmx_injects_no_style(client):
    page = client.get("/").text
    scripts = re.findall(r"<script\b[^>]*>(.*?)</script>", page, flags=re.DOTALL)
    assert scripts and all(body.strip() == "" for body in scripts)
    assert all("src=" in tag for tag in re.findall(r"<script\b[^>]*>", page))
    assert not re.search(r"\son[a-z]+=", page)  # no inline event handlers either
    config = re.search(r"<meta name=\"htmx-config\" content='([^']*)'>", page).group(1)
    assert json.loads(config)["includeIndicatorStyles"] is False  # its <style> breaks the CSP
    css = client.get("/static/doctune.css").text
    assert ".htmx-request .htmx-indicator" in css


# Size and disk ---------------------------------------------------------------------------------

def test_a_form_post_over_one_megabyte_is_refused_with_413(client, env):
    declared = client.post("/projects", data={"name": "x" * (2 * 1024 * 1024)})
    assert declared.status_code == 413
    assert "This request is too large: at most 1.0 MB is accepted here." in declared.text

    def chunks():  # no Content-Length: counted as it arrives
        yield b"name="
        for _ in range(3):
            yield b"y" * (512 * 1024)

    streamed = client.post("/projects", content=chunks(),
                           headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert streamed.status_code == 413 and "too large" in streamed.text
    _assert_secure_headers(streamed)
    assert _projects() == []


def test_only_a_multipart_upload_gets_the_large_cap(client, env):
    """A plain form is read whole (the accounts door looks in it for the CSRF field), so a
    form-encoded body to the upload address gets the small cap, not the upload's 2 GB."""
    with session_scope() as session:
        project_id = make_project(session, "Manuals").id
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    declared = client.post(f"/projects/{project_id}/documents", headers=form,
                           content=b"a=" + b"x" * (2 * 1024 * 1024))
    assert declared.status_code == 413
    assert "at most 1.0 MB is accepted here" in declared.text

    def chunks():
        for _ in range(3):
            yield b"b=" + b"y" * (512 * 1024) + b"&"

    # no CSRF header: the door reads the form for its field, and stops at the small cap
    cookie_only = {"Cookie": signed_in_headers(role="viewer")["Cookie"]}
    with TestClient(create_app(), base_url=local_url()) as bare:
        streamed = bare.post(f"/projects/{project_id}/documents", content=chunks(),
                             headers=form | cookie_only | {"Origin": local_url()})
    assert streamed.status_code == 413 and "too large" in streamed.text
    assert env.stored_files() == []


def test_an_upload_over_the_request_cap_is_refused_and_stores_nothing(env):
    with session_scope() as session:
        project_id = make_project(session, "Manuals").id
    settings.max_request_mb = 1
    body, ctype = multipart([(b"a.txt", b"alpha " * 100_000), (b"b.txt", b"beta " * 150_000)])
    with local_client(create_app()) as client:
        declared = client.post(f"/projects/{project_id}/documents", content=body,
                               headers={"Content-Type": ctype, **htmx("upload-results")})

        def chunks():
            for i in range(0, len(body), 64 * 1024):
                yield body[i : i + 64 * 1024]

        streamed = client.post(f"/projects/{project_id}/documents", content=chunks(),
                               headers={"Content-Type": ctype, **htmx("upload-results")})
        small = client.post(f"/projects/{project_id}/documents", headers=htmx("upload-results"),
                            files=[("files", ("c.txt", b"The office opens at 8.", "text/plain"))])
    for r in (declared, streamed):
        assert r.status_code == 413
        assert "one upload may hold up to 1.0 MB in all. Nothing was saved." in r.text
        assert "<html" not in r.text  # the note replaces the upload results, not the page
    assert small.status_code == 200 and "c.txt" in small.text
    assert len(env.stored_files()) == 1  # c.txt only: nothing of the refused two is left


def test_an_upload_that_would_fill_the_disk_is_refused_in_words(client, env):
    with session_scope() as session:
        project_id = make_project(session, "Manuals").id
    settings.min_free_disk_mb = 10**12  # more than any disk has free: the real check refuses
    full = client.post(f"/projects/{project_id}/documents", headers=htmx("upload-results"),
                       files=[("files", ("a.txt", b"Refunds take 5 days.", "text/plain"))])
    assert full.status_code == 200
    assert "Not saved: the disk that holds DocTune&#39;s data has only" in full.text
    assert "Free some space, then add the file again." in full.text
    assert env.stored_files() == []
    settings.min_free_disk_mb = 1024
    ok = client.post(f"/projects/{project_id}/documents", headers=htmx("upload-results"),
                     files=[("files", ("a.txt", b"Refunds take 5 days.", "text/plain"))])
    assert ok.status_code == 200 and "Not saved" not in ok.text
    assert len(env.stored_files()) == 1
