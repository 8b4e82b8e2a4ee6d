"""The whole path in a real Chromium, with the real worker behind the web app:
create a project, upload documents of several types, train, see the score, download."""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

import pytest
from playwright.sync_api import expect, sync_playwright

from tests.app.web import add_session_cookie
from tests.conftest import CHROMIUM_ARGS
from tests.fixtures import docs as fx

pytestmark = pytest.mark.browser


def test_documents_in_tuned_model_out(live_server, chromium_path, tmp_path):
    files = fx.write_sample_corpus(tmp_path / "corpus")
    broken = tmp_path / "broken.pdf"
    fx.make_corrupt(broken)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path, args=CHROMIUM_ARGS)
        page = browser.new_page(accept_downloads=True)
        add_session_cookie(page.context, live_server, role="member")  # signed in, a member
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.set_default_timeout(30_000)

        page.goto(live_server + "/")
        page.fill("#project-name", "Northwind handbook")
        page.click("text=Create project")
        page.wait_for_url("**/projects/*")

        # Choosing files uploads them at once (no extra click), as dropping them does.
        page.set_input_files("#file-input", [str(p) for p in files] + [str(broken)])
        page.wait_for_selector(".outcome")
        # The real worker reads every file; the list refreshes itself until none is pending.
        # (expect, not wait_for_function: the page's CSP refuses the eval that one polls with)
        expect(page.locator("#train button[type=submit]")).to_be_enabled(timeout=120_000)
        docs_text = page.locator("#documents").inner_text()
        assert "broken.pdf" in docs_text and "damaged" in docs_text.lower()
        assert "words" in docs_text

        page.click("text=Advanced settings")
        page.fill("#f-epochs", "2")
        page.click("#train button[type=submit]")
        page.wait_for_url("**/jobs/*")
        page.wait_for_selector("text=Did it get better?", timeout=300_000)
        card = page.locator("#job-live").inner_text()
        assert "facts" in card.lower() and "perplexity" in card.lower()
        assert page.locator("polyline.loss-line").count() == 1
        if shots := os.environ.get("DOCTUNE_TEST_SCREENSHOTS"):  # for a person to look at
            page.screenshot(path=str(Path(shots) / "job-done.png"), full_page=True)

        with page.expect_download() as dl:
            page.click("a[href$='/download/adapter']")
        data = (tmp_path / "adapter.zip")
        dl.value.save_as(data)
        names = zipfile.ZipFile(io.BytesIO(data.read_bytes())).namelist()
        assert any(n.endswith("adapter_model.safetensors") for n in names)
        assert any(n.endswith("README.md") for n in names)
        browser.close()
    assert errors == []
