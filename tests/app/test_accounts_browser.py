"""The first start in Chromium: the printed setup link makes the user the admin, who then
works, signs out and signs in again with the password chosen there."""

from __future__ import annotations

import pytest
from sqlalchemy import delete, select

from app.accounts import service as accounts
from app.accounts.models import User
from app.db import session_scope
from app.models import Project
from tests.conftest import CHROMIUM_ARGS

from .web import serve_app

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def server(app_env, chromium_path):
    pytest.importorskip("playwright.sync_api")
    with serve_app(app_env, "uvicorn-accounts.log") as port:
        yield f"http://127.0.0.1:{port}"


def test_the_setup_link_signs_the_first_user_in_as_admin(server, chromium_path, env):
    from playwright.sync_api import sync_playwright

    with session_scope() as session:
        session.execute(delete(User))
        token = accounts.setup_token_if_needed(session)  # what the launcher prints
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path, args=CHROMIUM_ARGS)
        page = browser.new_page()
        page.set_default_timeout(10_000)
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))

        page.goto(server + "/")
        assert page.url.startswith(server + "/signin")  # nobody is signed in yet
        page.goto(f"{server}/setup?token={token}")
        page.fill("#setup-name", "Ada")
        page.fill("#setup-password", "correct horse battery")
        page.click("text=Create the admin account")
        page.wait_for_url(server + "/")
        page.fill("#project-name", "Signed in")
        page.click("text=Create project")  # a plain form: its hidden CSRF field
        page.wait_for_url("**/projects/*")

        page.click("text=Sign out")
        page.wait_for_url("**/signin")
        page.goto(f"{server}/setup?token={token}")
        assert "has been used" in page.content()  # once only
        page.goto(server + "/signin")
        page.fill("#signin-name", "Ada")
        page.fill("#signin-password", "correct horse battery")
        page.click("button:has-text('Sign in')")
        page.wait_for_url(server + "/")
        assert "Signed in" in page.content() and "Accounts" in page.content()
        browser.close()
    assert errors == []
    with session_scope() as session:
        assert [(u.name, u.role) for u in session.scalars(select(User))] == [("Ada", "admin")]
        assert list(session.scalars(select(Project.name))) == ["Signed in"]
