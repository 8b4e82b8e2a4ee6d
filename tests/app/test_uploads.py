"""Uploads are untrusted input: types, sizes, names, duplicates, and every file's fate."""

from __future__ import annotations

import hashlib
import re
import tracemalloc

import anyio
import pytest
from sqlalchemy import select

from app.db import session_scope
from app.filetypes import SUPPORTED_LABEL
from app.main import create_app
from app.models import DocStatus, Document, Project
from app.services.documents import register_uploads
from app.services.uploads import UploadRejected, receive_files
from app.settings import settings
from tests.app.web import local_url, signed_in_headers
from tests.fixtures import docs

from .factories import MINI_PDF, htmx, make_document, make_project, multipart

DISCONNECT = "disconnect"  # in a chunk list: the browser goes away here
STORED_NAME = re.compile(r"^[0-9a-f]{32}\.[a-z]+$")


@pytest.fixture
def project_id(env) -> int:
    with session_scope() as session:
        return make_project(session, "Manuals").id


def _docs(project_id: int) -> list[Document]:
    with session_scope() as session:
        stmt = select(Document).where(Document.project_id == project_id).order_by(Document.id)
        return list(session.scalars(stmt))


def _upload(client, project_id: int, files: list[tuple[str, bytes]], headers=None):
    return client.post(
        f"/projects/{project_id}/documents",
        files=[("files", (name, content, "application/octet-stream")) for name, content in files],
        headers=headers if headers is not None else htmx("upload-results"),
    )


def _outcomes(html: str) -> list[tuple[str, str]]:
    """(fate, name) of each file in the upload result list, in order."""
    return re.findall(r'class="outcome outcome-(\w+)">.*?title="([^"]*)"', html, flags=re.DOTALL)


def test_several_files_are_stored_under_generated_names_and_queued(
    client, env, project_id, tmp_path
):
    facts = ["The X-200 warranty lasts 24 months.", "Support is open 9:00-17:00."]
    paths = [
        docs.make_txt(tmp_path / "notes.txt", facts),
        docs.make_md(tmp_path / "README.md", facts, title="Returns"),
        docs.make_html(tmp_path / "page.html", facts, title="Support"),
        docs.make_pdf(tmp_path / "manual.pdf", facts, title="Manual"),
        docs.make_docx(tmp_path / "policy.docx", facts),
        docs.make_qa_csv(tmp_path / "faq.csv", [("How long is the warranty?", "24 months")]),
    ]
    files = [(p.name, p.read_bytes()) for p in paths]
    r = _upload(client, project_id, files)
    assert r.status_code == 200
    assert "<html" not in r.text  # a fragment: results plus the refreshed list and Train panel
    assert [fate for fate, _ in _outcomes(r.text)] == ["accepted"] * len(files)
    assert 'id="documents"' in r.text and 'id="train"' in r.text
    assert r.text.count('hx-swap-oob="true"') == 2
    assert 'hx-trigger="load delay:1s"' in r.text  # the list polls while documents are read

    rows = _docs(project_id)
    assert [(d.original_name, d.kind, d.status) for d in rows] == [
        ("notes.txt", "txt", "pending"),
        ("README.md", "md", "pending"),
        ("page.html", "html", "pending"),
        ("manual.pdf", "pdf", "pending"),
        ("policy.docx", "docx", "pending"),
        ("faq.csv", "csv", "pending"),
    ]
    stored = env.stored_files()
    assert sorted(p.name for p in stored) == sorted(d.stored_name for d in rows)
    for doc, (_, content) in zip(rows, files, strict=True):
        path = settings.documents_dir / doc.stored_name
        assert STORED_NAME.match(doc.stored_name)
        assert path.read_bytes() == content
        assert doc.size_bytes == len(content)
        assert doc.sha256 == hashlib.sha256(content).hexdigest()
    assert env.queue_length("ingest") == len(files)  # one extraction task per accepted file


def test_plain_form_post_without_javascript_gets_the_whole_page(client, project_id):
    r = _upload(client, project_id, [("a.txt", b"hello")], headers={})
    assert r.status_code == 200
    assert "<html" in r.text and "outcome-accepted" in r.text


def test_unsupported_types_are_refused_and_nothing_is_stored(client, env, project_id):
    r = _upload(
        client,
        project_id,
        [
            ("setup.exe", b"MZ\x90\x00"),
            ("archive.zip", b"PK\x03\x04"),
            ("noextension", b"x"),
            (".txt", b"x"),
        ],
    )
    assert r.status_code == 200
    assert [fate for fate, _ in _outcomes(r.text)] == ["refused"] * 4
    assert SUPPORTED_LABEL in r.text
    assert env.stored_files() == []
    assert _docs(project_id) == []
    assert env.queue_length("ingest") == 0


def test_a_file_over_the_limit_is_cut_off_and_deleted_while_the_others_are_kept(
    client, env, project_id
):
    settings.max_upload_mb = 1
    limit = settings.max_upload_bytes
    r = _upload(
        client,
        project_id,
        [("big.txt", b"a" * (limit + 1)), ("exact.txt", b"b" * limit), ("small.md", b"# ok")],
    )
    assert r.status_code == 200
    assert _outcomes(r.text) == [
        ("refused", "big.txt"),
        ("accepted", "exact.txt"),
        ("accepted", "small.md"),
    ]
    assert "Too large: the limit is 1.0 MB per file." in r.text
    assert [d.original_name for d in _docs(project_id)] == ["exact.txt", "small.md"]
    stored = env.stored_files()
    assert len(stored) == 2 and not any(p.name.endswith(".part") for p in stored)
    assert env.queue_length("ingest") == 2


def test_a_request_larger_than_any_upload_may_be_is_refused_with_413(client, env, project_id):
    settings.max_upload_mb = 1
    settings.max_files_per_upload = 2  # at most 2 MB of files, plus framing
    r = _upload(client, project_id, [("huge.txt", b"x" * (4 * 1024 * 1024))])
    assert r.status_code == 413
    assert "This upload is too large" in r.text and "Nothing was saved" in r.text
    assert env.stored_files() == []
    assert _docs(project_id) == []


def _asgi_upload(
    project_id: int, chunks, headers: list[tuple[bytes, bytes]]
) -> tuple[int, bytes, int]:
    """Send a body chunk by chunk straight to the ASGI app; return status, body, chunks read."""
    app = create_app()
    read = 0
    status = 0
    body = b""

    async def receive():
        nonlocal read
        chunk = next(chunks, None)
        if chunk is None:
            return {"type": "http.request", "body": b"", "more_body": False}
        if chunk == DISCONNECT:
            return {"type": "http.disconnect"}
        read += 1
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message):
        nonlocal status, body
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            body += message.get("body", b"")

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": f"/projects/{project_id}/documents",
        "raw_path": b"",
        "root_path": "",
        "query_string": b"",
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 5000),
        "headers": [
            (b"host", local_url().split("//")[1].encode()),
            (b"origin", local_url().encode()),  # as the app's own page sends it
            *[(k.lower().encode(), v.encode()) for k, v in signed_in_headers().items()],
            *headers,
        ],
    }
    anyio.run(app, scope, receive, send)
    return status, body, read


def test_declared_size_over_the_bound_is_refused_before_reading_the_body(env, project_id):
    body, ctype = multipart([(b"a.txt", b"hello")])
    status, text, read = _asgi_upload(
        project_id,
        iter([body]),
        [(b"content-type", ctype.encode()), (b"content-length", str(10**12).encode())],
    )
    assert status == 413
    assert b"This upload is too large" in text
    assert read == 0
    assert env.stored_files() == []


def test_a_body_without_length_is_cut_off_at_the_bound(env, project_id):
    settings.max_upload_mb = 1
    settings.max_files_per_upload = 2  # bound: 2 MB of files + 1 MB framing
    head, ctype = multipart([(b"endless.txt", b"")])
    head = head[: head.index(b"\r\n\r\n") + 4]
    mib = b"z" * (1024 * 1024)
    endless = iter([head] + [mib] * 50)
    status, _, read = _asgi_upload(project_id, endless, [(b"content-type", ctype.encode())])
    assert status == 413
    assert read <= 5  # stopped reading a few MiB in, not at 50
    assert env.stored_files() == []
    assert _docs(project_id) == []


def test_a_browser_that_goes_away_mid_upload_leaves_nothing(env, project_id):
    body, ctype = multipart([(b"done.txt", b"complete"), (b"half.txt", b"h" * 100_000)])
    status, _, _ = _asgi_upload(
        project_id, iter([body[:-50_000], DISCONNECT]), [(b"content-type", ctype.encode())]
    )
    assert status == 400
    assert env.stored_files() == []
    assert _docs(project_id) == []


def test_files_are_streamed_to_disk_not_held_in_memory(env, project_id):
    size = 24 * 1024 * 1024
    head, ctype = multipart([(b"large.txt", b"")])
    head, tail = head[: head.index(b"\r\n\r\n") + 4], head[head.index(b"\r\n\r\n") + 4 :]
    piece = b"m" * (64 * 1024)

    def chunks():
        yield head
        for _ in range(size // len(piece)):
            yield piece
        yield tail

    tracemalloc.start()
    try:
        status, _, _ = _asgi_upload(project_id, chunks(), [(b"content-type", ctype.encode())])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert status == 200
    [doc] = _docs(project_id)
    assert doc.size_bytes == size
    assert (settings.documents_dir / doc.stored_name).stat().st_size == size
    assert peak < size / 4, f"peak Python memory {peak / 2**20:.1f} MiB for a 24 MiB upload"


WEIRD_NAMES = [
    (b"../../../etc/passwd.txt", "passwd.txt"),
    (b"..\\..\\windows\\win.ini.md", "win.ini.md"),
    (("é" * 300).encode() + b".md", None),  # 600 bytes of UTF-8: shortened on the page
    (b"evil\x00name\x07\x1b[31m.txt", "evilname[31m.txt"),
    ("invoice\u202etxt.exe.txt".encode(), "invoicetxt.exe.txt"),
    (b"<img src=x onerror=alert(1)>.html", "<img src=x onerror=alert(1)>.html"),
]


def test_weird_names_are_stored_under_generated_names_and_shown_escaped(client, env, project_id):
    parts = []
    for i, (raw, _shown) in enumerate(WEIRD_NAMES):
        parts.append((raw, f"content {i}".encode()))
    body, ctype = multipart(parts)
    r = client.post(
        f"/projects/{project_id}/documents",
        content=body,
        headers={"content-type": ctype, **htmx("upload-results")},
    )
    assert r.status_code == 200
    assert [fate for fate, _ in _outcomes(r.text)] == ["accepted"] * len(WEIRD_NAMES)

    rows = _docs(project_id)
    assert len(rows) == len(WEIRD_NAMES)
    assert rows[0].original_name == "../../../etc/passwd.txt"  # kept as given...
    assert rows[2].original_name == "é" * 300 + ".md"
    assert rows[3].original_name == "evil\ufffdname\x07\x1b[31m.txt"  # NUL: PostgreSQL refuses it
    root = settings.documents_dir.resolve()
    for doc in rows:  # ...but never used as a path
        assert STORED_NAME.match(doc.stored_name)
        assert (root / doc.stored_name).resolve().parent == root
    assert len(env.stored_files()) == len(WEIRD_NAMES)

    page = client.get(f"/projects/{project_id}").text
    for _raw, shown in WEIRD_NAMES:
        if shown is not None:
            assert shown.replace("<", "&lt;").replace(">", "&gt;") in page
    assert "<img src=x" not in page
    assert "\x00" not in page and "\x07" not in page and "\x1b" not in page and "\u202e" not in page
    assert "passwd" in page and "etc/passwd" not in page
    assert "é" * 40 + "…" in page  # a 300-character name is shortened for display


def test_empty_file_and_no_file_chosen(client, env, project_id):
    r = _upload(client, project_id, [("empty.txt", b""), ("ok.txt", b"fine")])
    assert _outcomes(r.text) == [("refused", "empty.txt"), ("accepted", "ok.txt")]
    assert "The file is empty." in r.text
    assert len(env.stored_files()) == 1

    body, ctype = multipart([(b"", b"")])  # what a browser sends when nothing was picked
    r = client.post(
        f"/projects/{project_id}/documents",
        content=body,
        headers={"content-type": ctype, **htmx("upload-results")},
    )
    assert r.status_code == 422
    assert "No files were chosen" in r.text


def test_too_many_files_in_one_upload(client, env, project_id):
    settings.max_files_per_upload = 2
    r = _upload(client, project_id, [("1.txt", b"1"), ("2.txt", b"2"), ("3.txt", b"3")])
    assert _outcomes(r.text) == [("accepted", "1.txt"), ("accepted", "2.txt"), ("refused", "3.txt")]
    assert "at most 2 per upload" in r.text
    assert len(env.stored_files()) == 2


def test_files_far_past_the_limit_are_counted_in_one_line_not_listed(client, env, project_id):
    settings.max_files_per_upload = 2
    names = [f"{i}.txt" for i in range(1, 8)]
    r = _upload(client, project_id, [(name, name.encode()) for name in names])
    assert _outcomes(r.text) == [
        ("accepted", "1.txt"), ("accepted", "2.txt"), ("refused", "3.txt"), ("refused", "4.txt"),
        ("refused", "3 more files"),
    ]
    assert "Please add these in other uploads." in r.text
    assert len(env.stored_files()) == 2


def test_not_a_form_upload(client, project_id):
    r = client.post(
        f"/projects/{project_id}/documents",
        content=b"{}",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 415
    assert "upload form" in r.text


def test_upload_to_unknown_project_is_404_and_stores_nothing(client, env):
    r = _upload(client, 4242, [("a.txt", b"hello")])
    assert r.status_code == 404
    assert env.stored_files() == []


def test_duplicates_are_recorded_not_stored_or_queued(client, env, project_id):
    r = _upload(
        client, project_id, [("guide.txt", b"same bytes"), ("guide (copy).txt", b"same bytes")]
    )
    assert _outcomes(r.text) == [("accepted", "guide.txt"), ("duplicate", "guide (copy).txt")]
    assert "Already uploaded as “guide.txt”" in r.text
    r = _upload(client, project_id, [("again.txt", b"same bytes")])
    assert _outcomes(r.text) == [("duplicate", "again.txt")]

    rows = _docs(project_id)
    assert [d.status for d in rows] == ["pending", "duplicate", "duplicate"]
    assert len(env.stored_files()) == 1  # only the first copy is kept
    assert env.queue_length("ingest") == 1
    page = client.get(f"/projects/{project_id}").text
    assert page.count("already uploaded as “guide.txt”") == 2


def test_a_failed_document_may_be_uploaded_again(client, env, project_id):
    with session_scope() as session:
        project = session.get(Project, project_id)
        make_document(
            session, project, "scan.pdf", DocStatus.failed, content=b"%PDF scan", error="No text."
        )
    r = _upload(client, project_id, [("scan.pdf", b"%PDF scan")])
    assert _outcomes(r.text) == [("accepted", "scan.pdf")]


def test_same_content_in_another_project_is_not_a_duplicate(client, project_id):
    with session_scope() as session:
        other = make_project(session, "Other").id
    _upload(client, project_id, [("a.txt", b"shared")])
    r = _upload(client, other, [("a.txt", b"shared")])
    assert _outcomes(r.text) == [("accepted", "a.txt")]


def test_one_bad_file_never_stops_the_others(client, env, project_id):
    settings.max_upload_mb = 1
    files = [
        ("first.txt", b"one"),
        ("virus.exe", b"MZ"),
        ("big.md", b"#" * (settings.max_upload_bytes + 10)),
        ("empty.html", b""),
        ("first-again.txt", b"one"),
        ("last.pdf", MINI_PDF),
    ]
    r = _upload(client, project_id, files)
    assert [fate for fate, _ in _outcomes(r.text)] == [
        "accepted",
        "refused",
        "refused",
        "refused",
        "duplicate",
        "accepted",
    ]
    assert [d.original_name for d in _docs(project_id)] == [
        "first.txt",
        "first-again.txt",
        "last.pdf",
    ]
    assert len(env.stored_files()) == 2


def test_a_rolled_back_upload_leaves_no_files_and_sends_nothing(env, project_id):
    body, ctype = multipart([(b"a.txt", b"alpha"), (b"b.md", b"beta")])

    async def stream():
        yield body

    received = anyio.run(
        lambda: receive_files(
            stream(), ctype, dest_dir=settings.documents_dir, max_file_bytes=10**6, max_files=10
        )
    )
    assert len(env.stored_files()) == 2
    with pytest.raises(RuntimeError), session_scope() as session:
        project = session.get(Project, project_id)
        register_uploads(session, project, received)
        raise RuntimeError("something after the upload failed")
    assert env.stored_files() == []
    assert _docs(project_id) == []
    assert env.queue_length("ingest") == 0


def test_a_cut_off_body_is_rejected_and_cleaned_up(env):
    body, ctype = multipart([(b"a.txt", b"alpha" * 1000)])

    async def stream():
        yield body[:3000]  # the connection drops inside the file

    with pytest.raises(UploadRejected):
        anyio.run(
            lambda: receive_files(
                stream(), ctype, dest_dir=settings.documents_dir, max_file_bytes=10**6, max_files=10
            )
        )
    assert env.stored_files() == []


def test_the_list_polls_while_documents_are_pending_then_stops(client, project_id):
    _upload(client, project_id, [("a.txt", b"hello there")])
    fragment = client.get(f"/projects/{project_id}", headers=htmx("documents"))
    assert fragment.status_code == 200
    assert fragment.text.lstrip().startswith('<div id="documents"')
    assert 'hx-trigger="load delay:1s"' in fragment.text
    assert 'id="train"' not in fragment.text  # the Train panel stays as it is meanwhile

    with session_scope() as session:
        for doc in session.scalars(select(Document).where(Document.project_id == project_id)):
            doc.status = DocStatus.extracted
            doc.word_count = 2
            doc.preview = "hello there"
    fragment = client.get(f"/projects/{project_id}", headers=htmx("documents"))
    listing = fragment.text.split('id="train"')[0]
    assert "load delay:1s" not in listing  # the quick polling stops...
    # ...for a slow one that only brings news (files from the watched folder): 204 till then.
    since = re.search(r'hx-get="([^"]*\?since=[^"]+)" hx-trigger="every 5s"', listing).group(1)
    assert client.get(since, headers=htmx("documents")).status_code == 204
    assert "status-ok" in fragment.text and "2 words" in fragment.text
    assert 'id="train"' in fragment.text and 'hx-swap-oob="true"' in fragment.text
    train = fragment.text.split('id="train"')[1]
    assert re.search(r"<button[^>]*>Train</button>", train)
    assert "disabled" not in re.search(r"<button[^>]*>Train</button>", train).group(0)
