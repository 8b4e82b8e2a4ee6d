"""The watched folder, with the watcher running as a real process on real file-system events.

One watcher process serves the module (`python -m app.watcher`, short stability window);
each test makes its own project, whose default inbox folder the watcher creates, and acts on
files the way a person or a program would: slow writes, bursts, edits, deletes, renames,
lock files, links, unreadable files. The database rows and the messages in Redis's "ingest"
queue are the evidence: every document is registered, and its extraction queued, exactly
once. Run as root, the watcher is started without the capabilities that let root read any
file, so permissions apply to it as to a normal user."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import delete, select

from app.audit import AuditEvent
from app.db import session_scope
from app.models import DocStatus, Document, Job, Project
from app.services.inbox import update_inbox_settings
from app.services.projects import create_project
from app.settings import settings
from tests.app.web import local_client
from tests.conftest import ROOT, wait_for

STABLE_S = 0.7
SETTLE_S = 2.5  # long enough for the watcher to act on anything it saw


@dataclass
class WatcherProc:
    proc: subprocess.Popen
    log: Path
    inbox_root: Path
    allowed: Path  # DOCTUNE_ALLOWED_FOLDERS: a project may also name a folder in here

    def log_text(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")


@pytest.fixture(scope="module")
def watcher(app_env, tmp_path_factory):
    root = tmp_path_factory.mktemp("inbox")
    allowed = tmp_path_factory.mktemp("allowed")
    saved = settings.inbox_dir, settings.allowed_folders
    settings.inbox_dir, settings.allowed_folders = root, [allowed]
    app_env.redis.flushdb()
    env = dict(os.environ)
    env.pop("DATABASE_URL", None)
    env.update(
        PYTHONPATH=str(ROOT),
        DOCTUNE_DATA_DIR=str(app_env.data_dir),
        REDIS_URL=app_env.redis_url,
        DOCTUNE_INBOX_DIR=str(root),
        DOCTUNE_ALLOWED_FOLDERS=str(allowed),
        DOCTUNE_WATCH_STABLE_S=str(STABLE_S),
        DOCTUNE_WATCH_RESCAN_S="3",
        DOCTUNE_WATCH_RETRIES="2",
        DOCTUNE_WATCH_SEEN_EVERY_S="1",
    )
    cmd = [sys.executable, "-m", "worker.cli", "watch"]  # `doctune watch`
    if os.geteuid() == 0 and shutil.which("setpriv"):
        # Root reads any file; without these capabilities it obeys permissions like a user.
        cmd = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *cmd]
    log = tmp_path_factory.mktemp("watcher-log") / "watcher.log"
    with open(log, "wb") as logf:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT)
    handle = WatcherProc(proc, log, root, allowed)
    try:
        wait_for(lambda: "watching" in handle.log_text(), 60, "watcher started", proc)
        yield handle
        assert proc.poll() is None, "the watcher died:\n" + handle.log_text()[-3000:]
        assert "Traceback" not in handle.log_text(), handle.log_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        settings.inbox_dir, settings.allowed_folders = saved
        with session_scope() as session:
            session.execute(delete(Job))
            session.execute(delete(Document))
            session.execute(delete(Project))
        for sub in ("documents", "jobs"):
            shutil.rmtree(app_env.data_dir / sub, ignore_errors=True)
        app_env.redis.flushdb()
    assert proc.returncode == 0, "the watcher did not stop cleanly on SIGTERM"


def new_project(name: str) -> tuple[int, Path]:
    """A project, and its default inbox folder once the watcher has made it."""
    with session_scope() as session:
        project_id = create_project(session, name).id
    folder = settings.inbox_dir / name
    wait_for(folder.is_dir, 15, f"inbox folder for {name}")
    return project_id, folder


def docs(project_id: int) -> list[Document]:
    with session_scope() as session:
        stmt = select(Document).where(Document.project_id == project_id).order_by(Document.id)
        return list(session.scalars(stmt))


def wait_docs(project_id: int, n: int, timeout: float = 20) -> list[Document]:
    wait_for(lambda: len(docs(project_id)) >= n, timeout, f"{n} documents")
    return docs(project_id)


def ingest_ids(app_env, project_id: int) -> list[int]:
    """Document ids in the "ingest" queue's messages (kombu's Redis list), for one project."""
    mine = {d.id for d in docs(project_id)}
    out = []
    for raw in app_env.redis.lrange("ingest", 0, -1):
        message = json.loads(raw)
        args = json.loads(base64.b64decode(message["body"]))[0]
        if args[0] in mine:
            out.append(args[0])
    return out


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_slow_write_is_taken_only_once_complete(watcher, app_env):
    project_id, folder = new_project("Slow write")
    content = b"".join(
        f"Line {i}: the warranty of model X{i} lasts {i % 48 + 1} months.\n".encode()
        for i in range(2000)
    )
    with open(folder / "report.txt", "wb") as fh:
        for i in range(0, len(content), 8000):  # 13 pieces, ~2.5 s: well past the window
            fh.write(content[i : i + 8000])
            fh.flush()
            time.sleep(0.2)
            assert docs(project_id) == [], "a file was taken before it was complete"
    [doc] = wait_docs(project_id, 1)
    time.sleep(SETTLE_S)
    [doc] = docs(project_id)
    assert (doc.size_bytes, doc.sha256) == (len(content), sha(content))
    assert (doc.source_path, doc.version, doc.status) == ("report.txt", 1, DocStatus.pending)
    assert ingest_ids(app_env, project_id) == [doc.id]
    with session_scope() as session:  # the admin's audit log names the watcher, once
        events = session.execute(select(AuditEvent.actor, AuditEvent.action, AuditEvent.detail)
                                 .where(AuditEvent.subject == "project “Slow write”")).all()
    assert [tuple(e) for e in events] == [("folder watcher", "folder_read", "report.txt")]


def test_a_burst_of_500_files_is_ingested_exactly_once_each(watcher, app_env, tmp_path):
    project_id, folder = new_project("Burst")
    staging = tmp_path / "export"
    staging.mkdir()
    for i in range(500):
        (staging / f"note-{i:03d}.txt").write_text(f"Note {i}: ticket {i * 7919} was solved.")
    started = time.monotonic()
    shutil.copytree(staging, folder / "export")  # one copy of 500 files, as a file manager does
    copied = time.monotonic()
    rows = wait_docs(project_id, 500, timeout=90)
    took = time.monotonic() - copied
    time.sleep(SETTLE_S)
    rows = docs(project_id)
    assert sorted(d.source_path for d in rows) == [f"export/note-{i:03d}.txt" for i in range(500)]
    assert all(d.version == 1 and d.retired_at is None for d in rows)
    assert all(d.status == DocStatus.pending for d in rows)
    assert sorted(ingest_ids(app_env, project_id)) == sorted(d.id for d in rows)
    print(
        f"\n500-file burst: copied in {copied - started:.2f} s, all registered "
        f"{took:.1f} s later (stability window {STABLE_S} s)"
    )


def test_editing_a_file_adds_a_version_and_retires_the_old_one(watcher, app_env):
    project_id, folder = new_project("Edits")
    policy = folder / "policy.md"
    policy.write_text("# Refunds\nRefunds are possible within 14 days.\n")
    [v1] = wait_docs(project_id, 1)
    policy.write_text("# Refunds\nRefunds are possible within 30 days.\n")
    v1, v2 = wait_docs(project_id, 2)
    assert (v1.source_path, v2.source_path) == ("policy.md", "policy.md")
    assert (v1.version, v2.version) == (1, 2)
    assert v1.retired_reason == "replaced" and v1.retired_at is not None
    assert v2.retired_at is None and v2.sha256 != v1.sha256
    assert (settings.documents_dir / v1.stored_name).is_file()  # retired, not deleted
    os.utime(policy)  # saved again without a change: no new version
    time.sleep(SETTLE_S)
    assert len(docs(project_id)) == 2
    assert sorted(ingest_ids(app_env, project_id)) == [v1.id, v2.id]


def test_deleting_a_file_retires_its_document(watcher):
    project_id, folder = new_project("Deletes")
    (folder / "old-price-list.txt").write_text("The basic plan costs 12 euros a month.")
    [doc] = wait_docs(project_id, 1)
    (folder / "old-price-list.txt").unlink()
    wait_for(lambda: docs(project_id)[0].retired_at is not None, 15, "retired")
    [doc] = docs(project_id)
    assert doc.retired_reason == "deleted"
    assert (settings.documents_dir / doc.stored_name).is_file()
    with local_client(_app()) as client:
        page = client.get(f"/projects/{project_id}").text
    assert "1 file removed from the folder" in page and "old-price-list.txt" in page


def test_moving_or_renaming_keeps_the_document(watcher, app_env):
    project_id, folder = new_project("Renames")
    (folder / "draft.txt").write_text("Support hours are 8:00 to 17:00 on weekdays.")
    [doc] = wait_docs(project_id, 1)
    (folder / "draft.txt").rename(folder / "Support hours — ü.txt")
    wait_for(lambda: docs(project_id)[0].source_path == "Support hours — ü.txt", 15, "renamed")
    (folder / "archive" / "2026").mkdir(parents=True)
    (folder / "Support hours — ü.txt").rename(folder / "archive" / "2026" / "hours.txt")
    wait_for(lambda: docs(project_id)[0].source_path == "archive/2026/hours.txt", 15, "moved")
    time.sleep(SETTLE_S)
    [moved] = docs(project_id)
    assert moved.id == doc.id and moved.retired_at is None and moved.version == 1
    assert ingest_ids(app_env, project_id) == [doc.id]  # read once, never again


def test_lock_temporary_and_hidden_files_are_ignored(watcher):
    project_id, folder = new_project("Ignores")
    for name in [
        "~$Budget.docx",
        ".~lock.Budget.odt#",
        "Budget.docx.tmp",
        "video.mp4.part",
        "setup.crdownload",
        ".hidden.txt",
        "notes.txt~",
        "~WRL0001.tmp",
    ]:
        (folder / name).write_bytes(b"not a document " * 10)
    (folder / ".git").mkdir()
    (folder / ".git" / "config.txt").write_text("hidden folder")
    (folder / "Budget.txt").write_text("The travel budget is 4,000 euros.")
    wait_docs(project_id, 1)
    time.sleep(SETTLE_S)
    assert [d.source_path for d in docs(project_id)] == ["Budget.txt"]


def test_links_to_files_outside_the_inbox_are_ignored_with_a_reason(watcher, tmp_path):
    project_id, folder = new_project("Links")
    outside = tmp_path / "salaries.txt"
    outside.write_text("Private: not for the model.")
    (folder / "soft.txt").symlink_to(outside)
    os.link(outside, folder / "hard.txt")
    (folder / "real.txt").write_text("Public: the office opens at 9.")
    (folder / "alias.txt").symlink_to(folder / "real.txt")  # inside: read like a copy
    rows = wait_docs(project_id, 2)
    time.sleep(SETTLE_S)
    rows = docs(project_id)
    assert {d.source_path: d.status for d in rows} == {
        "real.txt": DocStatus.pending,
        "alias.txt": DocStatus.duplicate,
    } or {d.source_path: d.status for d in rows} == {
        "alias.txt": DocStatus.pending,
        "real.txt": DocStatus.duplicate,
    }
    log = watcher.log_text()
    assert "'soft.txt': a link to something outside the inbox" in log
    assert "'hard.txt': a hard link to a file outside the inbox" in log


def test_an_unreadable_file_is_retried_then_failed_and_taken_once_readable(watcher):
    project_id, folder = new_project("Permissions")
    locked = folder / "locked.txt"
    locked.write_text("Escalations go to the duty manager.")
    locked.chmod(0)
    wait_for(
        lambda: docs(project_id) and docs(project_id)[0].status == DocStatus.failed,
        20,
        "marked failed",
    )
    [failed] = docs(project_id)
    assert "Permission denied" in failed.error and "Tried 2 times" in failed.error
    time.sleep(SETTLE_S)
    assert len(docs(project_id)) == 1  # not retried again and again
    locked.chmod(0o644)  # fixed: only the change time moves
    v1, v2 = wait_docs(project_id, 2)
    assert v1.retired_reason == "replaced"
    assert (v2.version, v2.status, v2.source_path) == (2, DocStatus.pending, "locked.txt")


def test_unicode_spaces_and_long_names_work(watcher):
    project_id, folder = new_project("Names ü 日本")
    names = [
        "Prüfbericht — 日本語 ñ.txt",
        "with  two spaces (draft) [1].md",
        ("very long name " * 15).strip() + ".txt",
    ]
    for i, name in enumerate(names):
        (folder / name).write_text(f"Document {i} about the Zürich office.")
    rows = wait_docs(project_id, 3)
    assert sorted(d.source_path for d in rows) == sorted(names)
    assert sorted(d.original_name for d in rows) == sorted(names)
    with local_client(_app()) as client:
        page = client.get(f"/projects/{project_id}").text
    assert "Prüfbericht — 日本語 ñ.txt" in page


def test_unsupported_and_empty_files_are_listed_as_failed(watcher):
    project_id, folder = new_project("Odd files")
    (folder / "photo.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a photo")
    (folder / "empty.txt").write_bytes(b"")
    rows = wait_docs(project_id, 2)
    errors = {d.source_path: d.error for d in rows}
    assert all(d.status == DocStatus.failed for d in rows)
    assert "not supported" in errors["photo.jpg"]
    assert errors["empty.txt"] == "The file is empty."


def test_a_missing_inbox_is_reported_and_picked_up_again(watcher):
    tmp_path = watcher.allowed / "usb-test"  # a folder elsewhere must be an allowed one
    usb = tmp_path / "usb"
    with session_scope() as session:
        project = create_project(session, "On a USB stick")
        update_inbox_settings(session, project, {"inbox_path": str(usb / "inbox")})
        project_id = project.id

    def status() -> str | None:
        with session_scope() as session:
            return session.get(Project, project_id).inbox_status

    wait_for(lambda: (status() or "").startswith("The folder"), 15, "reported missing")
    with local_client(_app()) as client:
        page = client.get(f"/projects/{project_id}").text
    assert "is missing" in page and str(usb / "inbox") in page and "data-copy" in page
    (usb / "inbox").mkdir(parents=True)
    wait_for(lambda: status() == "ok", 15, "found")
    (usb / "inbox" / "a.txt").write_text("Stock is counted every Friday.")
    wait_docs(project_id, 1)

    usb.rename(tmp_path / "unplugged")
    wait_for(lambda: status() != "ok", 15, "reported missing again")
    time.sleep(SETTLE_S)
    assert docs(project_id)[0].retired_at is None  # an unplugged drive deletes nothing
    (tmp_path / "unplugged").rename(usb)
    wait_for(lambda: status() == "ok", 15, "back")
    (usb / "inbox" / "b.txt").write_text("Returns are checked every Monday.")
    rows = wait_docs(project_id, 2)
    assert [d.retired_at for d in rows] == [None, None]
    assert [d.source_path for d in rows] == ["a.txt", "b.txt"]


def test_the_project_page_shows_the_folder_versions_and_last_seen(watcher):
    project_id, folder = new_project("Page")
    (folder / "faq.txt").write_text("Q: Opening hours? A: 9 to 5.")
    wait_docs(project_id, 1)
    (folder / "faq.txt").write_text("Q: Opening hours? A: 8 to 6.")
    wait_docs(project_id, 2)
    wait_for(lambda: docs(project_id)[1].last_seen_at is not None, 10, "last seen")
    with local_client(_app()) as client:
        page = client.get(f"/projects/{project_id}").text
    assert str(folder) in page and 'data-copy="#inbox-path"' in page
    assert "Watching this folder." in page
    assert "History" in page and "Version 1: added" in page
    assert 'class="num doc-version">2' in page

    # The open page polls its list with a fingerprint: "nothing new" (204) until a file lands.
    with session_scope() as session:  # as if the worker had read the file already
        for doc in session.scalars(select(Document).where(Document.project_id == project_id)):
            doc.status = DocStatus.extracted
    with local_client(_app()) as client:
        page = client.get(f"/projects/{project_id}").text
        poll = re.search(r'hx-get="([^"]*\?since=[^"]+)" hx-trigger="every 5s"', page).group(1)
        listing = {"HX-Request": "true", "HX-Target": "documents"}
        assert client.get(poll, headers=listing).status_code == 204
        (folder / "new-hours.txt").write_text("Q: Saturday? A: Closed.")
        wait_docs(project_id, 3)
        fresh = client.get(poll, headers=listing)
        assert fresh.status_code == 200 and "new-hours.txt" in fresh.text


def _app():
    from app.main import create_app

    return create_app()


def run_ingest(app_env) -> int:
    """Do the ingest worker's job on the queued messages: extract each document (the real
    worker code, run here so the test decides when documents become ready)."""
    from worker.ingest import ingest_document

    n = 0
    while raw := app_env.redis.lpop("ingest"):
        message = json.loads(raw)
        ingest_document(json.loads(base64.b64decode(message["body"]))[0][0])
        n += 1
    return n


def test_auto_train_waits_for_quiet_then_queues_exactly_one_job(watcher, app_env):
    quiet_s = 4.0
    import worker.ingest  # noqa: F401  (imported now: the first import is slow)

    project_id, folder = new_project("Auto after changes")
    app_env.redis.delete("ingest")  # earlier tests' documents: not this test's to extract
    with session_scope() as session:
        update_inbox_settings(
            session,
            session.get(Project, project_id),
            {"auto_train": "changes", "auto_quiet_min": "1"},
        )
        session.get(Project, project_id).auto_quiet_s = quiet_s  # seconds, for the test

    def jobs() -> list[Job]:
        with session_scope() as session:
            return list(session.scalars(select(Job).where(Job.project_id == project_id)))

    for wave in range(3):  # changes keep coming, each before the folder was quiet long enough
        for i in range(4):
            (folder / f"wave{wave}-{i}.txt").write_text(f"Wave {wave}: part {i} ships in {i} days.")
        wait_docs(project_id, 4 * (wave + 1))
        run_ingest(app_env)
    [job] = wait_for(jobs, 20, "the auto job")
    # The job came only after the documents had been left alone for the quiet period: the
    # newest document registered before the job is at least quiet_s older than the job.
    registered = [d.created_at for d in docs(project_id) if d.created_at <= job.created_at]
    assert (job.created_at - max(registered)).total_seconds() >= quiet_s
    assert job.auto and job.state == "queued"
    wait_for(lambda: len(jobs()[0].sources) == 12, 15, "every wave in the one job")

    (folder / "late.txt").write_text("A late change: part 9 ships in 9 days.")
    wait_docs(project_id, 13)
    run_ingest(app_env)
    wait_for(lambda: len(jobs()[0].sources) == 13, 15, "the queued job takes the change in")
    time.sleep(quiet_s + 1.5)
    assert [j.id for j in jobs()] == [job.id]  # still one job, and one message for it
    messages = [
        json.loads(base64.b64decode(json.loads(m)["body"]))[0][0]
        for m in app_env.redis.lrange("train", 0, -1)
    ]
    assert messages.count(job.id) == 1


def test_pipes_devices_and_links_to_them_never_block_the_watcher(watcher, tmp_path):
    """A FIFO blocks whoever opens it for reading until something writes to it: reached
    directly, through a link, or in a sub-folder, it must not stop any project's files."""
    pipes_id, pipes = new_project("Pipes")
    os.mkfifo(pipes / "pipe.txt")
    (pipes / "via-link.txt").symlink_to(pipes / "pipe.txt")
    (pipes / "deeper").mkdir()
    os.mkfifo(pipes / "deeper" / "notes.md")
    os.mkfifo(tmp_path / "outside.txt")
    (pipes / "outside-link.txt").symlink_to(tmp_path / "outside.txt")
    time.sleep(SETTLE_S)  # the watcher has scanned the pipes (and would be stuck on them)
    other_id, other = new_project("After the pipes")
    (other / "hours.txt").write_text("The office opens at 8.")
    (pipes / "real.txt").write_text("The canteen closes at 3.")
    [doc] = wait_docs(other_id, 1, timeout=15)
    assert doc.source_path == "hours.txt"
    [mine] = wait_docs(pipes_id, 1, timeout=15)
    time.sleep(SETTLE_S)
    assert [d.source_path for d in docs(pipes_id)] == ["real.txt"] == [mine.source_path]
    log = watcher.log_text()
    assert "'pipe.txt': not a regular file (a pipe, device or socket): never opened" in log
    assert "'deeper/notes.md': not a regular file" in log
    assert "'via-link.txt': a link to something not a regular file" in log
    assert "'outside-link.txt': a link to something outside the inbox" in log


def test_a_folder_outside_the_allowed_ones_is_refused_in_words(watcher, tmp_path):
    """Only folders in the inbox root or DOCTUNE_ALLOWED_FOLDERS: refused on the form (links
    resolved), and refused again by the watcher, which stops watching a folder that no
    longer qualifies and says so on the project page."""
    from app.services.errors import InvalidInput
    from app.services.inbox import REFUSED_STATUS

    home = tmp_path / "home"
    home.mkdir()
    (home / "diary.txt").write_text("Private: not for the model.")
    (watcher.allowed / "sneaky").symlink_to(home)
    with session_scope() as session:
        project = create_project(session, "Elsewhere")
        project_id = project.id
        for wanted in (Path.home(), Path("/"), Path("/etc"), home, watcher.inbox_root):
            with pytest.raises(InvalidInput) as refused:
                update_inbox_settings(session, project, {"inbox_path": str(wanted)})
            assert str(wanted) in refused.value.errors["inbox_path"]
        with pytest.raises(InvalidInput) as refused:
            update_inbox_settings(session, project, {"inbox_path": str(watcher.allowed / "sneaky")})
        message = refused.value.errors["inbox_path"]
        assert f"(it leads to {home})" in message and "an admin adds it" in message
        assert project.inbox_path is None

    # A folder that was allowed when set and is a link to the home folder now: not watched.
    shared = watcher.allowed / "shared"
    shared.mkdir()
    (shared / "faq.txt").write_text("Q: Parking? A: Level -2.")
    with session_scope() as session:
        update_inbox_settings(session, session.get(Project, project_id), {"inbox_path": str(shared)})
    wait_docs(project_id, 1)
    shared.rename(tmp_path / "shared-was")
    shared.symlink_to(home)

    def status() -> str | None:
        with session_scope() as session:
            return session.get(Project, project_id).inbox_status

    wait_for(lambda: status() == REFUSED_STATUS, 15, "the watcher refuses the folder")
    (home / "letter.txt").write_text("Private too.")
    time.sleep(SETTLE_S)
    assert [d.source_path for d in docs(project_id)] == ["faq.txt"]
    assert docs(project_id)[0].retired_at is None  # refusing a folder deletes nothing
    with local_client(_app()) as client:
        page = client.get(f"/projects/{project_id}").text
    assert "This folder is not watched." in page and f"it leads to {home}" in page
    assert "Watching this folder." not in page
    assert f"{home}/diary.txt" not in watcher.log_text()

    shared.unlink()  # the real folder back: watched again
    (tmp_path / "shared-was").rename(shared)
    wait_for(lambda: status() == "ok", 15, "watched again")
