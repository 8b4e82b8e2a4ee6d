"""Opening a watched file safely: what the watcher reads is the file its scan saw.

Between a scan and the read (the file must first hold still), the name can be swapped for
a link to a file elsewhere, a link re-pointed, or the file replaced by a FIFO, which blocks
a plain open() until something writes to it. These tests make those swaps on a real disk
at exactly that moment, driving the watcher's own scan and read in this process (the
watcher process itself is tested in test_watcher.py)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from app.services.uploads import receive_local_file
from app.watcher.loop import Watcher
from app.watcher.scan import scan_folder
from app.watcher.state import Inbox

SECRET = "Private: the salaries of everyone."


@pytest.fixture
def folders(env, tmp_path):
    """An inbox folder, a secret file outside it, and the data dir's documents folder."""
    from app.settings import settings

    inbox = tmp_path / "inbox"
    inbox.mkdir()
    secret = tmp_path / "salaries.txt"
    secret.write_text(SECRET)
    return inbox, secret, settings.documents_dir


def scanned(inbox: Path) -> tuple[Watcher, Inbox]:
    """The watcher's state right after a scan, with every file already held still."""
    watcher = Watcher()
    state = Inbox(1, inbox)
    watcher._apply_scan(state, scan_folder(inbox), time.monotonic() - 3600)
    return watcher, state


def stored_texts(documents: Path) -> list[str]:
    if not documents.exists():
        return []
    return [p.read_text(errors="replace") for p in documents.iterdir() if p.is_file()]


def bounded(fn, timeout_s: float = 5.0):
    """Run `fn` in a thread; fail (instead of hanging the suite) if it blocks."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"blocked for more than {timeout_s} s"
    return out[0]


def swap_for_link(path: Path, target: Path) -> None:
    tmp = path.with_name(".swap")
    tmp.symlink_to(target)
    os.replace(tmp, path)  # atomic, as an attacker would do it


def test_the_scan_records_which_file_it_saw(folders):
    inbox, _, _ = folders
    (inbox / "a.txt").write_text("The office opens at 8.")
    (inbox / "alias.txt").symlink_to(inbox / "a.txt")
    found = scan_folder(inbox)
    st = os.stat(inbox / "a.txt")
    assert found.files["a.txt"].ident == (st.st_dev, st.st_ino)
    assert found.files["a.txt"].target is None
    assert found.files["alias.txt"].ident == (st.st_dev, st.st_ino)
    assert found.files["alias.txt"].target == os.path.realpath(inbox / "a.txt")


def test_a_file_swapped_for_a_link_after_the_scan_is_not_read(folders):
    inbox, secret, documents = folders
    (inbox / "a.txt").write_text("The office opens at 8.")
    watcher, state = scanned(inbox)
    swap_for_link(inbox / "a.txt", secret)
    assert watcher._read(state, "a.txt") is None
    assert SECRET not in stored_texts(documents)
    assert state.candidates["a.txt"].seen is None  # waits for the next scan, which skips it
    watcher._apply_scan(state, scan_folder(inbox), time.monotonic())
    assert "a.txt" not in state.candidates


def test_a_link_re_pointed_after_the_scan_is_not_followed(folders):
    inbox, secret, documents = folders
    (inbox / "real.txt").write_text("The office opens at 8.")
    (inbox / "alias.txt").symlink_to(inbox / "real.txt")
    watcher, state = scanned(inbox)
    swap_for_link(inbox / "alias.txt", secret)
    assert watcher._read(state, "alias.txt") is None
    assert SECRET not in stored_texts(documents)
    item = watcher._read(state, "real.txt")  # the file itself is read as usual
    assert item is not None and item.received.path.read_text() == "The office opens at 8."


def test_a_folder_swapped_for_a_link_after_the_scan_is_not_read_through(folders, tmp_path):
    """O_NOFOLLOW guards only a path's last name: the folder above the file, swapped for a
    link to a folder elsewhere, must not lead the read outside the inbox. (Here the scanned
    folder itself is moved out, so the file keeps the identity the scan saw, as a swap timed
    between the scan's listing and its look inside would give.)"""
    inbox, _, documents = folders
    (inbox / "sub").mkdir()
    (inbox / "sub" / "salaries.txt").write_text(SECRET)
    watcher, state = scanned(inbox)
    os.rename(inbox / "sub", tmp_path / "private")
    (inbox / "sub").symlink_to(tmp_path / "private", target_is_directory=True)
    item = watcher._read(state, "sub/salaries.txt")
    assert SECRET not in stored_texts(documents)
    assert item is not None and item.received.path is None
    assert "not inside the watched folder" in item.received.refused


def test_a_folder_swapped_for_a_link_while_the_scan_looks_is_not_listed(
    folders, tmp_path, monkeypatch
):
    """The scan lists a folder, then looks inside each sub-folder: one swapped for a link to
    a folder elsewhere in between must not put that folder's names in the inbox."""
    from app.watcher import scan

    inbox, _, _ = folders
    (inbox / "sub").mkdir()
    (inbox / "sub" / "notes.txt").write_text("The office opens at 8.")
    (tmp_path / "private").mkdir()
    (tmp_path / "private" / "salaries.txt").write_text(SECRET)
    listed = os.scandir

    def swap_then_list(path):
        if Path(path) == inbox / "sub":  # the moment between the parent's listing and this
            os.rename(inbox / "sub", tmp_path / "was-sub")
            (inbox / "sub").symlink_to(tmp_path / "private", target_is_directory=True)
        return listed(path)

    monkeypatch.setattr(scan.os, "scandir", swap_then_list)
    found = scan_folder(inbox)
    assert "sub/salaries.txt" not in found.files
    assert found.skipped["sub"] == "a folder replaced by a link while it was looked at"


def test_a_file_replaced_by_a_fifo_after_the_scan_does_not_block(folders):
    inbox, _, _ = folders
    (inbox / "a.txt").write_text("The office opens at 8.")
    (inbox / "b.txt").write_text("The canteen closes at 3.")
    watcher, state = scanned(inbox)
    (inbox / "a.txt").unlink()
    os.mkfifo(inbox / "a.txt")
    assert bounded(lambda: watcher._read(state, "a.txt")) is None
    item = bounded(lambda: watcher._read(state, "b.txt"))
    assert item.received.path.read_text() == "The canteen closes at 3."


def test_receive_local_file_opens_only_the_regular_file_it_was_told_of(folders, tmp_path):
    inbox, secret, documents = folders
    os.mkfifo(inbox / "pipe.txt")
    got = bounded(lambda: receive_local_file(
        inbox / "pipe.txt", dest_dir=documents, max_file_bytes=1 << 20))
    assert got.path is None and "not a regular file" in got.refused
    (inbox / "link.txt").symlink_to(secret)
    got = receive_local_file(inbox / "link.txt", dest_dir=documents, max_file_bytes=1 << 20)
    assert got.path is None and "It is a link" in got.refused and not got.retryable

    (inbox / "a.txt").write_text("The office opens at 8.")
    st = os.stat(inbox / "a.txt")
    other = os.stat(secret)
    got = receive_local_file(inbox / "a.txt", dest_dir=documents, max_file_bytes=1 << 20,
                             expect=(other.st_dev, other.st_ino))
    assert got.path is None and "replaced by another one" in got.refused and got.retryable
    got = receive_local_file(secret, dest_dir=documents, max_file_bytes=1 << 20,
                             expect=(st.st_dev, st.st_ino), name="a.txt")
    assert got.path is None  # the name says a.txt, the file is another one: not read
    got = receive_local_file(inbox / "a.txt", dest_dir=documents, max_file_bytes=1 << 20,
                             expect=(st.st_dev, st.st_ino), name="Opening hours.txt")
    assert got.path.read_text() == "The office opens at 8."
    assert got.original_name == "Opening hours.txt"
    assert SECRET not in stored_texts(documents)
    got = receive_local_file(inbox / "a.txt", dest_dir=documents, max_file_bytes=1 << 20)
    assert got.path.read_text() == "The office opens at 8."  # the CLI's way: no identity
