"""The htmx behaviour in a real Chromium: picking and dropping files, the lists that refresh
themselves and stop, the Train form, the live job panel and Cancel.

The app runs in uvicorn on the test database; the worker's part (extracting text, moving a
job along) is played by writing the rows directly, as the worker would."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from sqlalchemy import select

from app.db import session_scope
from app.models import DocStatus, Document, Job, JobState

from .web import add_session_cookie, serve_app

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def server(app_env):
    if _chromium() is None:
        pytest.skip("no Chromium on this machine (apt-get install chromium)")
    pytest.importorskip("playwright.sync_api")
    with serve_app(app_env, "uvicorn-browser.log") as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture
def page(server, env):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=_chromium(), args=["--no-sandbox"])
        page = browser.new_page()
        add_session_cookie(page.context, server)  # signed in as an admin
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.set_default_timeout(8000)
        yield page
        browser.close()
    assert errors == [], errors  # no JavaScript errors on any page


def _wait_until_enabled(page, selector: str) -> None:
    """Polls without eval: the page's CSP (no 'unsafe-eval') refuses wait_for_function's."""
    from playwright.sync_api import expect

    expect(page.locator(selector)).to_be_enabled()


def test_upload_then_train_then_cancel(server, page, tmp_path):
    for name, content in [("notes.txt", "The warranty lasts 24 months."), ("setup.exe", "MZ")]:
        (tmp_path / name).write_text(content)
    (tmp_path / "again.txt").write_text("The warranty lasts 24 months.")

    page.goto(server + "/")
    page.fill("#project-name", "Browser walk")
    page.click("text=Create project")
    page.wait_for_url("**/projects/*")

    # Choosing files sends them at once; each file gets its fate.
    page.set_input_files(
        "#file-input", [str(tmp_path / n) for n in ("notes.txt", "again.txt", "setup.exe")]
    )
    page.wait_for_selector(".outcome")
    fates = page.locator(".outcome").evaluate_all("els => els.map(e => e.className)")
    assert fates == [
        "outcome outcome-accepted",
        "outcome outcome-duplicate",
        "outcome outcome-refused",
    ]
    assert page.locator("#train button[type=submit]").is_disabled()
    assert "still being read" in page.locator("#train-reason").inner_text()
    assert page.locator("#documents").get_attribute("hx-trigger") == "load delay:1s"

    # The "worker" reads the file: the list refreshes by itself, then stops; Train unlocks.
    with session_scope() as session:
        for doc in session.scalars(select(Document).where(Document.status == DocStatus.pending)):
            doc.status, doc.word_count, doc.preview = (
                DocStatus.extracted,
                5,
                "The warranty lasts 24 months.",
            )
    _wait_until_enabled(page, "#train button[type=submit]")
    # The quick polling stops; a slow one stays for files arriving in the watched folder.
    assert page.locator("#documents").get_attribute("hx-trigger") == "every 5s"

    # A drop on the drop zone uploads too.
    page.dispatch_event(
        "[data-dropzone]",
        "drop",
        {
            "dataTransfer": page.evaluate_handle(
                "() => { const d = new DataTransfer();"
                " d.items.add(new File(['dropped text'], 'dropped.md')); return d; }"
            )
        },
    )
    page.wait_for_selector(".outcome-accepted >> text=dropped.md")
    with session_scope() as session:
        for doc in session.scalars(select(Document).where(Document.status == DocStatus.pending)):
            doc.status, doc.word_count = DocStatus.extracted, 2
    _wait_until_enabled(page, "#train button[type=submit]")

    # A bad Advanced value is explained; a good one starts the job.
    page.click("text=Advanced settings")
    page.fill("#f-epochs", "99")
    page.click("#train button[type=submit]")
    assert "from 1 to 50" in page.locator("#epochs-error").inner_text()
    page.fill("#f-epochs", "2")
    page.click("#train button[type=submit]")
    page.wait_for_url("**/jobs/*")
    job_id = int(page.url.rsplit("/", 1)[-1])
    assert page.locator(".badge").inner_text() == "waiting to start"

    # The panel follows the job without a reload.
    with session_scope() as session:
        job = session.get(Job, job_id)
        assert job.params["epochs"] == 2
        job.state, job.step, job.total_steps = JobState.running, 10, 50
        job.loss_history = [[1, 3.0], [10, 2.0]]
    page.wait_for_selector("text=Step 10 of 50")
    assert page.locator("polyline.loss-line").count() == 1

    page.on("dialog", lambda dialog: dialog.accept())
    page.click("text=Cancel training")
    page.wait_for_selector("text=Cancelling…")
    with session_scope() as session:
        job = session.get(Job, job_id)
        assert job.cancel_requested
        job.state = JobState.cancelled
    page.wait_for_selector("text=This job was cancelled.")
    assert page.locator("#job-live").get_attribute("hx-trigger") is None
