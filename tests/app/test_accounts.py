"""Accounts through the real app and database: the door on every route, sign-in and out,
the setup link, invitations, roles, API tokens and CSRF."""

from __future__ import annotations

import re
from urllib.parse import parse_qs, urlsplit

import pytest
from sqlalchemy import delete, select
from starlette.routing import BaseRoute, Mount

from app.accounts import limiter
from app.accounts import service as accounts
from app.accounts.door import COOKIE, CSRF_HEADER, EXEMPT_PATHS
from app.accounts.models import ApiToken, Role, SignInSession, User
from app.db import session_scope
from app.launcher import setup_link
from app.main import create_app
from app.models import Job, JobState, Project
from tests.app.factories import htmx, make_job, make_project
from tests.app.web import local_client, local_url, signed_in_headers

PASSWORD = "correct horse battery"


@pytest.fixture(autouse=True)
def _fresh_limiter():
    limiter.forget()
    yield
    limiter.forget()


@pytest.fixture
def no_accounts(env):
    """No users at all, as on the first start."""
    with session_scope() as session:
        session.execute(delete(User))  # sessions, tokens and links go with them (cascade)
    yield
    with session_scope() as session:
        session.execute(delete(User))


def _anonymous():
    return local_client(create_app(), role=None)


def _user(name: str, role: str, password: str = PASSWORD) -> int:
    with session_scope() as session:
        return accounts.create_user(session, name, role, password).id


def _csrf(html: str) -> str:
    return re.search(r'<meta name="csrf-token" content="([^"]+)">', html).group(1)


def _project_and_job() -> tuple[int, int]:
    with session_scope() as session:
        project = make_project(session, "Handbook")
        return project.id, make_job(session, project, JobState.queued).id


# The door on every route ------------------------------------------------------------------


def _every_route(routes, prefix: str = ""):
    """(path, route) for every route the app answers, inside included routers too."""
    for route in routes:
        if hasattr(route, "original_router"):  # FastAPI 0.16x keeps included routers whole
            yield from _every_route(route.original_router.routes,
                                    prefix + route.include_context.prefix)
        elif isinstance(route, Mount):
            assert route.path == "/static", route.path  # the only open mount
        else:
            yield prefix + route.path, route


def _example_path(path: str, route: BaseRoute) -> str:
    for name, convertor in route.param_convertors.items():
        value = "1" if convertor.__class__.__name__ == "IntegerConvertor" else "adapter"
        path = path.replace("{" + name + "}", value).replace("{" + name + ":int}", value)
    return path


def test_every_route_but_the_open_ones_refuses_an_anonymous_request(env):
    app = create_app()

    @app.post("/test-only/added-later")  # a route someone adds tomorrow, with no thought
    def _later() -> dict:
        return {"ok": True}

    checked = []
    with local_client(app, role=None) as client:
        for route_path, route in _every_route(app.routes):
            if route_path in EXEMPT_PATHS:
                continue
            for method in sorted(route.methods - {"HEAD"}):
                path = _example_path(route_path, route)
                r = client.request(method, path, follow_redirects=False)
                checked.append((method, route_path))
                if path.startswith("/api/"):
                    assert r.status_code == 401, (method, path, r.status_code)
                    assert "Sign in" in r.json()["detail"]
                elif path.startswith("/v1/"):  # the OpenAI-compatible API, in its shape
                    assert r.status_code == 401, (method, path, r.status_code)
                    assert "Sign in" in r.json()["error"]["message"]
                else:
                    assert r.status_code == 303, (method, path, r.status_code)
                    assert r.headers["location"].startswith("/signin?next="), (method, path)
    assert ("POST", "/test-only/added-later") in checked
    assert {("GET", "/"), ("POST", "/projects/{project_id}/documents"),
            ("GET", "/jobs/{job_id}/download/{kind}"), ("GET", "/api/projects"),
            ("GET", "/admin/users"), ("POST", "/account/tokens"), ("GET", "/v1/models"),
            ("POST", "/v1/chat/completions"), ("GET", "/chat/replies/{message_id}/events"),
            ("GET", "/admin/audit")} <= set(checked)
    assert len(checked) >= 20
    with session_scope() as session:
        assert list(session.scalars(select(Project))) == []


def test_the_open_routes_answer_anonymously(env):
    with _anonymous() as client:
        assert client.get("/healthz").status_code == 200
        assert client.get("/signin").status_code == 200
        assert client.get("/static/doctune.css").status_code == 200
        page = client.get("/", follow_redirects=True)
    assert page.url.path == "/signin" and 'name="password"' in page.text
    r = _anonymous().get("/projects/1", headers=htmx("documents"))
    assert r.status_code == 401 and r.headers["HX-Redirect"] == "/signin?next=%2Fprojects%2F1"


# Sign-in and out --------------------------------------------------------------------------


def test_sign_in_sets_a_fresh_httponly_cookie_and_sign_out_revokes_it(env):
    _user("Ada", "member")
    cookies = []
    for _ in range(2):
        with _anonymous() as client:
            r = client.post("/signin", data={"name": "ada", "password": PASSWORD,
                                              "next": "/projects/7"}, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/projects/7"
        header = r.headers["set-cookie"]
        assert header.startswith(f"{COOKIE}=") and "HttpOnly" in header
        assert "samesite=lax" in header.lower() and "Secure" not in header  # plain http here
        cookies.append(r.cookies[COOKIE])
    assert cookies[0] != cookies[1]  # a new token at every sign-in
    with session_scope() as session:
        stored = set(session.scalars(select(SignInSession.token_hash)))
    assert not stored & set(cookies)  # kept as hashes only

    with local_client(create_app(), role=None,
                      headers={"Cookie": f"{COOKIE}={cookies[0]}"}) as client:
        home = client.get("/")
        assert home.status_code == 200 and "Ada" in home.text
        assert client.post("/signout", data={"csrf_token": _csrf(home.text)},
                           follow_redirects=False).headers["location"] == "/signin"
        again = client.get("/", follow_redirects=False)
    assert again.status_code == 303 and again.headers["location"].startswith("/signin")


def test_a_wrong_password_is_refused_and_attempts_are_limited(env):
    _user("Grace", "admin")
    with _anonymous() as client:
        for _ in range(5):
            r = client.post("/signin", data={"name": "Grace", "password": "wrong password"})
            assert r.status_code == 401 and "do not match" in r.text
            assert COOKIE not in r.cookies
        blocked = client.post("/signin", data={"name": "Grace", "password": PASSWORD})
    assert blocked.status_code == 429 and "Too many sign-in attempts" in blocked.text
    assert COOKIE not in blocked.cookies  # even the right password waits
    unknown = _anonymous().post("/signin", data={"name": "Nobody", "password": PASSWORD})
    assert unknown.status_code == 429  # the same client address, another name: limited too


def test_the_limit_counts_per_name_and_per_address():
    for _ in range(5):
        limiter.failed("Grace", "10.0.0.1")
    assert limiter.wait_s("grace", "10.0.0.2") > 0  # the name, from anywhere
    assert limiter.wait_s("Linus", "10.0.0.1") > 0  # the address, for any name
    assert limiter.wait_s("Linus", "10.0.0.2") == 0


def test_the_count_is_kept_in_redis_for_every_web_process(env):
    for _ in range(5):
        limiter.failed("Grace", "10.0.0.1")
    limiter._limiters.clear()  # as another web process (or a restart) starts: nothing in memory
    assert 0 < limiter.wait_s("Grace", "10.0.0.9") <= 300
    assert any(b"doctune-sign-in" in key for key in env.redis.keys("LIMITS*"))


def test_without_redis_the_count_is_kept_in_this_process(env, monkeypatch):
    from app.settings import settings

    monkeypatch.setattr(settings, "redis_url", "redis://127.0.0.1:1/0")  # nothing listens
    limiter._limiters.clear()
    for _ in range(5):
        limiter.failed("Grace", "10.0.0.1")
    assert limiter.wait_s("Grace", "10.0.0.2") > 0
    assert limiter.wait_s("Linus", "10.0.0.2") == 0


def test_next_never_leaves_the_site(env):
    _user("Ada", "member")
    for target in ("//evil.example/", "https://evil.example/", "/\\evil.example"):
        r = _anonymous().post("/signin", data={"name": "Ada", "password": PASSWORD,
                                               "next": target}, follow_redirects=False)
        assert r.headers["location"] == "/"


# The setup link ---------------------------------------------------------------------------


def test_the_setup_link_makes_the_first_admin_once(no_accounts):
    link = setup_link()
    assert link is not None and link.startswith(f"{local_url()}/setup?token=")
    newer = setup_link()  # a restart prints a new link; the old one stops working
    token = parse_qs(urlsplit(newer).query)["token"][0]
    with _anonymous() as client:
        assert client.get(urlsplit(link).path + "?" + urlsplit(link).query).status_code == 403
        form = client.get(f"/setup?token={token}")
        assert form.status_code == 200 and "makes you DocTune's admin" in form.text
        short = client.post("/setup", data={"token": token, "name": "Ada", "password": "short"})
        assert short.status_code == 422 and "at least 8 characters" in short.text
        r = client.post("/setup", data={"token": token, "name": "Ada", "password": PASSWORD},
                        follow_redirects=False)
        assert r.status_code == 303 and COOKIE in r.cookies
        home = client.get("/")
        assert home.status_code == 200 and "Accounts" in home.text  # signed in, as an admin
    with _anonymous() as client:
        reuse = client.post("/setup", data={"token": token, "name": "Eve", "password": PASSWORD})
        assert reuse.status_code == 403 and "has been used" in reuse.text
        assert client.get(f"/setup?token={token}").status_code == 403
    with session_scope() as session:
        assert [(u.name, u.role) for u in session.scalars(select(User))] == [("Ada", "admin")]
    assert setup_link() is None  # there is an admin now


# Invitations and roles ------------------------------------------------------------------


def test_an_admin_invites_a_colleague_who_signs_in_with_the_link(env):
    with local_client(create_app()) as admin:
        r = admin.post("/admin/users", data={"name": "Linus", "role": "viewer"})
    assert r.status_code == 201
    link = re.search(r'id="invite-link">([^<]+)<', r.text).group(1)
    assert link.startswith(f"{local_url()}/setup?token=")
    path = link.removeprefix(local_url())
    token = parse_qs(urlsplit(link).query)["token"][0]
    with _anonymous() as client:
        assert "Welcome, Linus" in client.get(path).text
        assert client.post("/setup", data={"token": token, "password": PASSWORD},
                           follow_redirects=False).status_code == 303
        assert client.get("/account").text.count("viewer") >= 1
    assert _anonymous().get(path).status_code == 403  # once only
    signin = _anonymous().post("/signin", data={"name": "Linus", "password": PASSWORD},
                               follow_redirects=False)
    assert signin.status_code == 303


def test_a_viewer_reads_but_cannot_upload_train_cancel_or_change_folders(env):
    project_id, job_id = _project_and_job()
    with local_client(create_app(), role="viewer") as viewer:
        assert viewer.get(f"/projects/{project_id}").status_code == 200
        assert viewer.get(f"/jobs/{job_id}").status_code == 200
        assert viewer.get("/api/projects").status_code == 200
        refused = {
            "create": viewer.post("/projects", data={"name": "Mine"}),
            "upload": viewer.post(f"/projects/{project_id}/documents", headers=htmx("upload-results"),
                                  files=[("files", ("a.txt", b"The office opens at 8.", "text/plain"))]),
            "train": viewer.post(f"/projects/{project_id}/jobs", data={"method": "lora"}),
            "cancel": viewer.post(f"/jobs/{job_id}/cancel"),
            "folder": viewer.post(f"/projects/{project_id}/inbox", data={"inbox_path": "/"}),
            "accounts": viewer.get("/admin/users"),
        }
    assert {k: r.status_code for k, r in refused.items()} == dict.fromkeys(refused, 403)
    assert "look but not change" in refused["upload"].text
    with session_scope() as session:
        assert [p.name for p in session.scalars(select(Project))] == ["Handbook"]
        job = session.get(Job, job_id)
        assert job.cancel_requested is False and len(session.get(Project, project_id).jobs) == 1
        assert session.get(Project, project_id).inbox_path is None


def test_a_member_works_on_projects_but_cannot_manage_accounts(env):
    _, job_id = _project_and_job()
    with local_client(create_app(), role="member") as member:
        assert member.post("/projects", data={"name": "Mine"},
                           follow_redirects=False).status_code == 303
        assert member.post(f"/jobs/{job_id}/cancel", follow_redirects=False).status_code == 303
        assert member.get("/admin/users").status_code == 403
        invite = member.post("/admin/users", data={"name": "Mallory", "role": "admin"})
        assert invite.status_code == 403 and "Only an admin" in invite.text
    with session_scope() as session:
        assert session.scalar(select(User).where(User.name == "Mallory")) is None
        assert session.get(Job, job_id).cancel_requested is True


def test_an_admin_changes_roles_and_disables_and_keeps_one_admin(env):
    linus = _user("Linus", "member")
    with local_client(create_app(), role=None, headers=signed_in_headers("member", "Linus")) as c:
        assert c.get("/").status_code == 200
        with local_client(create_app()) as admin:
            assert admin.post(f"/admin/users/{linus}", data={"role": "viewer"},
                              follow_redirects=False).status_code == 303
            assert c.post("/projects", data={"name": "x"}).status_code == 403  # now a viewer
            admin.post(f"/admin/users/{linus}", data={"action": "disable"})
            assert c.get("/", follow_redirects=False).status_code == 303  # signed out
            signin = _anonymous().post("/signin", data={"name": "Linus", "password": PASSWORD})
            assert signin.status_code == 401
            with session_scope() as session:
                me = session.scalar(select(User).where(User.name == "test admin"))
                others = session.scalars(select(User).where(User.role == "admin",
                                                            User.id != me.id)).all()
                for other in others:
                    other.disabled = True
            assert admin.post("/admin/users/999999", data={"role": "member"}).status_code == 404
            last = admin.post(f"/admin/users/{me.id}", data={"role": "member"})
            assert last.status_code == 422 and "at least one admin" in last.text
    with session_scope() as session:
        assert session.get(User, me.id).role == Role.admin
        for other in session.scalars(select(User).where(User.role == "admin")):
            other.disabled = False


# API tokens -----------------------------------------------------------------------------


def test_api_tokens_work_for_the_api_until_revoked(env):
    with session_scope() as session:
        make_project(session, "Handbook")
    with local_client(create_app(), role="viewer") as owner:
        page = owner.post("/account/tokens", data={"label": "nightly report"})
        assert page.status_code == 201
        token = re.search(r'id="new-token">([^<]+)<', page.text).group(1)
        assert token not in owner.get("/account").text  # shown once
        bearer = {"Authorization": f"Bearer {token}"}
        with _anonymous() as script:
            r = script.get("/api/projects", headers=bearer)
            assert r.status_code == 200 and [p["name"] for p in r.json()] == ["Handbook"]
            assert script.get("/api/projects", headers={"Authorization": "Bearer nope"}
                              ).status_code == 401
            assert script.get("/", headers=bearer, follow_redirects=False).status_code == 303
            with session_scope() as session:
                row = session.scalar(select(ApiToken))
                assert row.token_hash != token and token not in row.token_hash
                assert row.last_used_at is not None
            assert owner.post(f"/account/tokens/{row.id}/revoke",
                              follow_redirects=False).status_code == 303
            gone = script.get("/api/projects", headers=bearer)
            assert gone.status_code == 401 and "Sign in" in gone.json()["detail"]


# CSRF ------------------------------------------------------------------------------------


def test_an_unsafe_request_without_the_sessions_csrf_token_is_refused(env):
    headers = signed_in_headers()
    right = headers.pop(CSRF_HEADER)
    with local_client(create_app(), role=None, headers=headers) as client:
        missing = client.post("/projects", data={"name": "No token"})
        wrong = client.post("/projects", data={"name": "Wrong"},
                            headers={CSRF_HEADER: signed_in_headers()[CSRF_HEADER]})
        upload = client.post("/projects/1/documents", headers=htmx("upload-results"),
                             files=[("files", ("a.txt", b"x", "text/plain"))])
        field = client.post("/projects", data={"name": "Form field", "csrf_token": right},
                            follow_redirects=False)
        header = client.post("/projects", data={"name": "Header"}, follow_redirects=False,
                             headers={CSRF_HEADER: right})
    for r in (missing, wrong, upload):
        assert r.status_code == 403 and "security token" in r.text
    assert field.status_code == 303 and header.status_code == 303
    with session_scope() as session:
        assert sorted(session.scalars(select(Project.name))) == ["Form field", "Header"]


def test_pages_carry_the_token_for_forms_and_htmx(client):
    page = client.get("/").text
    token = _csrf(page)
    assert f'hx-headers=\'{{"X-CSRF-Token": "{token}"}}\'' in page
    assert f'name="csrf_token" value="{token}"' in page


def test_the_setup_link_command_prints_a_link_until_there_is_an_admin(no_accounts, capsys):
    from app.accounts.__main__ import main

    assert main(["setup-link"]) == 0
    assert capsys.readouterr().out.startswith(f"{local_url()}/setup?token=")
    _user("Ada", "admin")
    assert main(["setup-link"]) == 1 and "already has an admin" in capsys.readouterr().out


def test_a_password_change_signs_out_the_other_sessions(env):
    _user("Ada", "member")
    elsewhere = signed_in_headers("member", "Ada")
    here = signed_in_headers("member", "Ada")
    with local_client(create_app(), role=None, headers=here) as client:
        wrong = client.post("/account/password", data={"current": "nope", "password": "x" * 12})
        assert wrong.status_code == 422 and "not your current password" in wrong.text
        ok = client.post("/account/password",
                         data={"current": PASSWORD, "password": "a new long password"})
        assert ok.status_code == 200 and "other sessions are signed out" in ok.text
        assert client.get("/").status_code == 200  # this one stays signed in
    with local_client(create_app(), role=None, headers=elsewhere) as other:
        assert other.get("/", follow_redirects=False).status_code == 303
    new = _anonymous().post("/signin", data={"name": "Ada", "password": "a new long password"},
                            follow_redirects=False)
    assert new.status_code == 303
