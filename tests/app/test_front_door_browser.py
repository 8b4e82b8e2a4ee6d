"""The front door in a real Chromium: DNS rebinding and cross-site posts are refused, while the
app's own pages (plain form posts and htmx requests) work under the CSP without one violation.

DNS rebinding, as the reviewer ran it: Chromium's `--host-resolver-rules` maps evil.test to
127.0.0.1, so a document of origin http://evil.test:<port> talks to DocTune, its requests
carrying `Host` and `Origin` of evil.test; Playwright's `evaluate` plays the attacker's script
in that document. (A page served by Playwright instead would count as a public address, and
Chromium's own Local Network Access check would then refuse the requests before DocTune saw
them: the test would prove nothing about DocTune.) The cross-site form comes from a second
real server on another loopback port, under another name."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from app.db import session_scope
from app.models import Document, Job, JobState, Project
from tests.conftest import CHROMIUM_ARGS

from .factories import make_project
from .web import add_session_cookie, serve_app

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]

ATTACK = """async ([projectId, jobId]) => {
  const out = {};
  async function attempt(name, url, init) {
    try {
      const r = await fetch(url, init);
      out[name] = [r.status, await r.text()];
    } catch (e) {
      out[name] = [0, String(e)];
    }
  }
  const form = (fields) => ({method: "POST", body: new URLSearchParams(fields)});
  await attempt("read", "/api/projects", {});
  await attempt("page", "/projects/" + projectId, {});
  await attempt("create", "/projects", form({name: "Pwned"}));
  await attempt("train", "/projects/" + projectId + "/jobs", form({method: "lora"}));
  await attempt("cancel", "/jobs/" + jobId + "/cancel", form({}));
  return out;
}"""


@pytest.fixture(scope="module")
def server(app_env, chromium_path):
    pytest.importorskip("playwright.sync_api")
    with serve_app(app_env, "uvicorn-front-door.log") as port:
        yield port


@pytest.fixture
def browser(server, chromium_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=chromium_path,
            args=[*CHROMIUM_ARGS, "--host-resolver-rules=MAP evil.test 127.0.0.1"],
        )
        yield browser
        browser.close()


def _secrets(env) -> tuple[int, int]:
    """A project and a queued job the attacker would like to see, train or cancel."""
    with session_scope() as session:
        project = make_project(session, "Secret plans")
        job = Job(project_id=project.id, state=JobState.queued, method="lora", params={})
        session.add(job)
        session.flush()
        return project.id, job.id


def test_a_page_on_a_rebound_name_cannot_read_create_train_or_cancel(server, browser, env):
    project_id, job_id = _secrets(env)
    page = browser.new_page()
    page.set_default_timeout(10_000)
    landing = page.goto(f"http://evil.test:{server}/")
    assert landing.status == 400  # DocTune does not even serve its page under that name
    assert page.evaluate("location.origin") == f"http://evil.test:{server}"

    results = page.evaluate(ATTACK, [project_id, job_id])

    # Every request reached DocTune (the script can read each answer: it is same-origin for
    # the page) and every one was refused for its Host, before any route ran.
    assert {name: status for name, (status, _) in results.items()} == {
        "read": 400, "page": 400, "create": 400, "train": 400, "cancel": 400,
    }
    for _, text in results.values():
        assert "DocTune does not answer to the address" in text
        assert "Secret plans" not in text
    with session_scope() as session:
        assert list(session.scalars(select(Project.name))) == ["Secret plans"]
        assert [(j.id, j.state) for j in session.scalars(select(Job))] == [
            (job_id, JobState.queued)
        ]

    # The same script on DocTune's own address is allowed to read: the refusals above came
    # from the name, not from something else in the script or the browser.
    own = browser.new_page()
    add_session_cookie(own.context, f"http://127.0.0.1:{server}")  # signed in, as its user is
    own.goto(f"http://127.0.0.1:{server}/")
    status, text = own.evaluate(
        "async () => { const r = await fetch('/api/projects'); return [r.status, await r.text()]; }"
    )
    assert status == 200 and "Secret plans" in text


@pytest.fixture
def attacker_site(tmp_path):
    """Another web server on this machine (another port, another name): the attacker's page."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    site = tmp_path / "site"
    site.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd=site, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.1)
    yield site, f"http://evil.test:{port}"
    proc.terminate()
    proc.wait(timeout=10)


def test_a_form_on_another_site_cannot_post_to_doctune(server, browser, env, attacker_site):
    """Classic CSRF (no rebinding): a page elsewhere submits a form to DocTune's own address.
    Host is DocTune's, so only the Origin check stands between the form and a new project."""
    _, job_id = _secrets(env)
    site, site_url = attacker_site
    target = f"http://127.0.0.1:{server}"
    (site / "win.html").write_text(
        f'<!doctype html><form method="post" action="{target}/jobs/{job_id}/cancel"></form>'
        f'<form method="post" action="{target}/projects"><input name="name" value="Pwned">'
        "</form>"
    )
    page = browser.new_page()
    page.set_default_timeout(10_000)
    for index in (0, 1):
        page.goto(site_url + "/win.html")
        with page.expect_navigation():
            page.evaluate(f"document.forms[{index}].submit()")
        assert "Requests from other web sites are not accepted" in page.content()
        assert site_url in page.content()  # the refusal names where it came from
    with session_scope() as session:
        assert list(session.scalars(select(Project.name))) == ["Secret plans"]
        assert session.get(Job, job_id).state == JobState.queued


def test_the_apps_own_pages_work_under_the_csp(server, browser, env, tmp_path):
    page = browser.new_page()
    add_session_cookie(page.context, f"http://127.0.0.1:{server}")  # signed in as an admin
    page.set_default_timeout(10_000)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    # Records every CSP violation on every page (init scripts are not subject to the CSP).
    page.add_init_script(
        "window.__csp = []; document.addEventListener('securitypolicyviolation',"
        " e => window.__csp.push(e.violatedDirective));"
    )
    page.goto(f"http://127.0.0.1:{server}/")
    page.fill("#project-name", "Through the front door")
    page.click("text=Create project")  # a plain form post: Chromium sends Origin
    page.wait_for_url("**/projects/*")
    (tmp_path / "hours.txt").write_text("The office opens at 8:00.")
    page.set_input_files("#file-input", [str(tmp_path / "hours.txt")])  # an htmx post
    page.wait_for_selector(".outcome-accepted >> text=hours.txt")
    assert page.evaluate("window.__csp") == []
    assert errors == []
    with session_scope() as session:
        assert list(session.scalars(select(Project.name))) == ["Through the front door"]
        assert [d.original_name for d in session.scalars(select(Document))] == ["hours.txt"]

    # The detector works and the policy is on: an inline style or script is refused here.
    violated = page.evaluate("""() => new Promise(resolve => {
        document.addEventListener("securitypolicyviolation", e => resolve(e.violatedDirective));
        document.head.insertAdjacentHTML("beforeend", "<style>body { color: red }</style>");
    })""")
    assert violated.startswith("style-src")
