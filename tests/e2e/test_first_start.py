"""The first start, as a new user has it: `doctune up` on a fresh machine (its own data dir,
inbox and private Redis, no REDIS_URL or DATABASE_URL) prints a one-time setup link and opens
it in the browser once the app answers; in Chromium that link makes the user the admin, works
once only, and the chosen password signs in again. SIGTERM then stops every process the
launcher started."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from tests.conftest import CHROMIUM_ARGS, ROOT

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]

NAME, PASSWORD = "Ada Admin", "correct horse battery"
LINK = re.compile(r"(https?://\S+/setup\?token=\S+)")

# What the launcher's `webbrowser` call runs (BROWSER names it): it writes down the address it
# was asked to open and whether the web app was listening at that moment, and opens nothing.
STAND_IN_BROWSER = """#!{python}
import json, socket, sys
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2).close()
    listening = True
except OSError:
    listening = False
with open({record!r}, "w") as out:
    json.dump({{"url": sys.argv[1], "listening": listening}}, out)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _live_children(pid: int) -> tuple[list[psutil.Process], list[str]]:
    """The launcher's live descendants and their command lines; one that exited and is
    not yet reaped (the stand-in browser, once it has written its record) is left out."""
    children, commands = [], []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            commands.append(" ".join(p.cmdline()))
        except psutil.Error:  # a zombie, or gone meanwhile
            continue
        children.append(p)
    return children, commands


def _wait(predicate, timeout_s: float, what: str, output: list[str]):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.1)
    pytest.fail(f"no {what} after {timeout_s:.0f} s; `doctune up` printed:\n" + "".join(output))


def test_doctune_up_prints_and_opens_a_setup_link_that_makes_the_admin(
        tmp_path, tiny_base_model, chromium_path):
    from playwright.sync_api import sync_playwright

    port, redis_port = _free_port(), _free_port()
    base = f"http://127.0.0.1:{port}"
    record = tmp_path / "opened.json"
    browser_cmd = tmp_path / "stand-in-browser"
    browser_cmd.write_text(STAND_IN_BROWSER.format(python=sys.executable, port=port,
                                                   record=str(record)))
    browser_cmd.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("DOCTUNE_") and k not in ("REDIS_URL", "DATABASE_URL",
                                                         "TEST_REDIS_URL", "WAYLAND_DISPLAY")}
    env.update(
        DOCTUNE_DATA_DIR=str(tmp_path / "data"), DOCTUNE_INBOX_DIR=str(tmp_path / "inbox"),
        DOCTUNE_PORT=str(port), DOCTUNE_PRIVATE_REDIS_PORT=str(redis_port),
        DOCTUNE_BASE_MODEL=str(tiny_base_model),  # not the embedded one: nothing to convert
        DISPLAY=":99", BROWSER=str(browser_cmd),  # a display, and the stand-in as its browser
        PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1",
    )
    started = time.monotonic()
    launcher = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "up"], cwd=tmp_path, env=env,  # no stray .env
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    output: list[str] = []
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in launcher.stdout:
            output.append(line)
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    children: list[psutil.Process] = []
    try:
        def link_printed() -> str | None:
            while not lines.empty():
                if found := LINK.search(lines.get()):
                    return found.group(1)
            assert launcher.poll() is None, "doctune up exited:\n" + "".join(output)
            return None

        link = _wait(link_printed, 60, "setup link", output)
        assert link.startswith(f"{base}/setup?token=")
        assert f"DocTune is running: {base}" in "".join(output)
        assert "DOCTUNE_TLS_CERTFILE" not in "".join(output)  # loopback: no LAN warning

        opened = _wait(lambda: record.exists() and record.read_text(), 60, "browser", output)
        assert json.loads(opened) == {"url": link, "listening": True}  # once it answered

        children, commands = _live_children(launcher.pid)
        for part in ("redis-server", "-Q ingest", "-Q train", "app.watcher", "uvicorn"):
            assert any(part in c for c in commands), (part, commands)

        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium_path, args=CHROMIUM_ARGS)
            page = browser.new_page()
            page.set_default_timeout(15_000)
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))

            page.goto(link)
            page.fill("#setup-name", NAME)
            page.fill("#setup-password", PASSWORD)
            page.click("text=Create the admin account")
            page.wait_for_url(base + "/")
            nav = page.locator("nav.account-nav")
            assert NAME in nav.inner_text()
            assert nav.locator("a[href='/admin/users']").inner_text() == "Accounts"
            assert page.locator(".lan-warning").count() == 0

            page.goto(link)  # spent
            assert "has been used" in page.content()

            fresh = browser.new_context().new_page()  # no cookie: signs in with the password
            fresh.set_default_timeout(15_000)
            fresh.goto(base + "/")
            fresh.wait_for_url("**/signin**")
            fresh.fill("#signin-name", NAME)
            fresh.fill("#signin-password", PASSWORD)
            fresh.click("button:has-text('Sign in')")
            fresh.wait_for_url(base + "/")
            assert NAME in fresh.locator("nav.account-nav").inner_text()
            browser.close()
        assert errors == []

        launcher.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        assert launcher.wait(timeout=30) == 0
        while any(_running(p) for p in children) and time.monotonic() - stopped < 30:
            time.sleep(0.1)
        left = [f"{p.pid} {commands[i]}" for i, p in enumerate(children) if _running(p)]
        assert left == [], left  # nothing the launcher started outlives it
        assert time.monotonic() - stopped < 30
        assert "Stopping DocTune" in "".join(output)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        for p in children:
            if _running(p):
                p.kill()
    assert time.monotonic() - started < 60, "the first start took too long"
