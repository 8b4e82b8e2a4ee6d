"""The launcher's LAN-mode decisions: the address it prints and polls (https under TLS), the
web command (uvicorn's --ssl-* flags), the start-up warning off loopback over plain http, and
when it opens a browser. The whole first start runs for real in tests/e2e/test_first_start.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from app import launcher
from app.settings import settings


def test_children_do_not_outlive_a_killed_launcher(tmp_path):
    """`kill -9` of `doctune up` gives it no chance to stop what it started: each child
    gets SIGTERM from the kernel instead, so nothing is left holding a port."""
    script = (
        "from app.children import spawn; import time\n"
        "child = spawn(['sleep', '300']); print(child.pid, flush=True); time.sleep(300)"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert os.path.exists(f"/proc/{child}")
    parent.kill()
    parent.wait(timeout=10)
    deadline = time.monotonic() + 10
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(child)


def test_one_launcher_per_data_folder(monkeypatch, tmp_path, capsys):
    """A second `doctune up` on the same data folder stops before touching anything (it
    would otherwise take over the first one's Redis), and says where the first one is."""
    first = launcher.hold_data_dir(tmp_path)
    assert first is not None
    assert launcher.hold_data_dir(tmp_path) is None
    monkeypatch.setattr(settings, "data_dir", tmp_path)
    monkeypatch.setattr(launcher, "upgrade_to_head", lambda: pytest.fail("went on"))
    assert launcher.run() == 1
    assert "DocTune is already running from this data folder" in capsys.readouterr().err
    first.close()  # as when the first one ends, however it ends
    again = launcher.hold_data_dir(tmp_path)
    assert again is not None
    again.close()


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for its (new) parent to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def tls_on(monkeypatch, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    monkeypatch.setattr(settings, "tls_certfile", cert)
    monkeypatch.setattr(settings, "tls_keyfile", key)
    return cert, key


def test_plain_http_serves_and_prints_http(monkeypatch):
    monkeypatch.setattr(settings, "host", "0.0.0.0")
    assert launcher._address() == f"http://127.0.0.1:{settings.port}"
    assert "--ssl-certfile" not in launcher.web_cmd()


def test_tls_serves_https_and_prints_https(monkeypatch, tls_on):
    cert, key = tls_on
    monkeypatch.setattr(settings, "host", "::")
    assert launcher._address() == f"https://127.0.0.1:{settings.port}"
    cmd = launcher.web_cmd()
    assert cmd[cmd.index("--ssl-certfile") + 1] == str(cert)
    assert cmd[cmd.index("--ssl-keyfile") + 1] == str(key)
    assert cmd[cmd.index("--host") + 1] == "::"


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.20", "doctune.lan", "::"])
def test_a_lan_host_over_plain_http_is_warned_about_at_start(monkeypatch, host):
    monkeypatch.setattr(settings, "host", host)
    warning = launcher.lan_warning()
    assert warning is not None and f"DOCTUNE_HOST={host}" in warning
    assert "unencrypted" in warning and "DOCTUNE_TLS_CERTFILE" in warning


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_loopback_is_not_warned_about(monkeypatch, host):
    monkeypatch.setattr(settings, "host", host)
    assert launcher.lan_warning() is None


def test_a_lan_host_with_tls_is_not_warned_about(monkeypatch, tls_on):
    monkeypatch.setattr(settings, "host", "0.0.0.0")
    assert launcher.lan_warning() is None


def test_a_browser_is_opened_only_where_it_can_be_seen_and_is_wanted(monkeypatch):
    monkeypatch.setattr(settings, "open_browser", True)
    assert launcher.browser_wanted({"DISPLAY": ":0"}, "linux")
    assert launcher.browser_wanted({"WAYLAND_DISPLAY": "wayland-0"}, "linux")
    assert not launcher.browser_wanted({}, "linux")  # over ssh, a server: no display
    assert not launcher.browser_wanted({"DISPLAY": ""}, "linux")
    assert launcher.browser_wanted({}, "darwin") and launcher.browser_wanted({}, "win32")
    monkeypatch.setattr(settings, "open_browser", False)  # DOCTUNE_OPEN_BROWSER=false
    assert not launcher.browser_wanted({"DISPLAY": ":0"}, "linux")
    assert not launcher.browser_wanted({}, "darwin")


def test_nothing_answers_on_a_closed_port_and_the_poll_gives_up():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, never listening
        started = time.monotonic()
        assert launcher.answering(closed, timeout_s=0.5) is False
        assert launcher.answering(closed, timeout_s=30, go_on=lambda: False) is False
        assert time.monotonic() - started < 10  # stopping DocTune ends the wait at once
