"""Receiving uploaded files: untrusted input, streamed straight to disk.

The multipart body is parsed as it arrives; each file part goes to a generated name in
the documents folder in chunks while it is counted and hashed, so nothing is ever held
whole in memory, a file over the limit is cut off at the limit (and its partial copy
deleted), a file of an unsupported type is never written at all, and one bad file does
not stop the others."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
import unicodedata
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import anyio
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from app.filetypes import SUPPORTED_KINDS, SUPPORTED_LABEL, kind_for_filename
from app.settings import settings

FILE_FIELD = "files"
# Plain (non-file) form fields are tiny; anything bigger is not from our form.
MAX_FIELD_BYTES = 64 * 1024
# Room for the multipart boundaries and part headers on top of the files themselves.
MULTIPART_OVERHEAD_BYTES = 1024 * 1024
WRITE_CHUNK_BYTES = 1024 * 1024
# While a file is written the free space is checked again after this many bytes; a file starts
# only with this much room above the margin, so an upload cannot take the disk under it.
DISK_CHECK_BYTES = 16 * 1024 * 1024


class UploadRejected(Exception):
    """The whole request is refused (too large, not a form upload, cut off)."""

    def __init__(self, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code


@dataclass
class ReceivedFile:
    """One file part of an upload, received (path set) or refused (reason set)."""

    original_name: str  # exactly as sent: may hold slashes, control characters, anything
    kind: str | None = None
    size: int = 0
    sha256: str = ""
    path: Path | None = None  # the written copy under the documents folder
    refused: str | None = None  # why it was not kept, in plain words
    # The refusal came from the disk (locked, vanished, permission denied): worth a retry.
    retryable: bool = False

    @property
    def name(self) -> str:
        return display_name(self.original_name)


def display_name(original: str) -> str:
    """The name to show: the last path component, without control or bidi-override characters
    (a right-to-left override, U+202E, makes "invoice[U+202E]fdp.exe" read as a PDF).
    Jinja's autoescape takes care of the rest."""
    base = original.replace("\\", "/").rsplit("/", 1)[-1]
    shown = "".join(
        ch for ch in base if unicodedata.category(ch) not in ("Cc", "Cf") and ch != "\ufffd"
    )
    shown = " ".join(shown.split())
    return shown or "(unnamed file)"


def human_size(n: int) -> str:
    size = float(n)
    for unit in ("bytes", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{int(size)} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} bytes"  # pragma: no cover


def max_request_bytes(max_file_bytes: int, max_files: int) -> int:
    """The largest upload request accepted at all: every file at the limit, plus framing."""
    return max_files * max_file_bytes + MULTIPART_OVERHEAD_BYTES


def stored_name_for(kind: str, display: str) -> str:
    """A generated name for the copy on disk: random, with a known-safe extension."""
    ext = display.rsplit(".", 1)[-1].lower() if "." in display else ""
    if ext not in SUPPORTED_KINDS:
        ext = kind
    return f"{uuid.uuid4().hex}.{ext}"


class _Receiver:
    """python-multipart callbacks writing each file part to its own file."""

    def __init__(
        self,
        dest_dir: Path,
        max_file_bytes: int,
        max_files: int,
        charset: str,
        min_free_bytes: int = 0,
    ):
        self.dest_dir = dest_dir
        self.max_file_bytes = max_file_bytes
        self.max_files = max_files
        self.charset = charset
        self.min_free_bytes = min_free_bytes  # the data disk keeps this much free
        self._unchecked = 0  # bytes written since the free space was last checked
        self.files: list[ReceivedFile] = []
        self._n_file_parts = 0
        self._unlisted: ReceivedFile | None = None  # the one row for files past twice the limit
        self._header_name = b""
        self._header_value = b""
        self._disposition: bytes | None = None
        self._mode = "field"  # this part: "field" (counted, ignored), "skip" or "write"
        self._current: ReceivedFile | None = None  # the file part being written, if any
        self._out: BinaryIO | None = None
        self._part_path: Path | None = None
        self._hash = hashlib.sha256()
        self._field_bytes = 0

    # Part headers
    def on_part_begin(self) -> None:
        self._disposition = None
        self._mode = "field"
        self._current = None
        self._field_bytes = 0

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def on_header_end(self) -> None:
        if self._header_name.strip().lower() == b"content-disposition":
            self._disposition = self._header_value
        self._header_name = b""
        self._header_value = b""

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        if b"filename" not in options:
            return  # a plain field: counted and ignored
        self._mode = "skip"
        if _decode(options.get(b"name", b""), self.charset) != FILE_FIELD:
            return  # a file in some other field: not from our form, read past it
        original = _decode(options[b"filename"], self.charset)
        if not original:
            return  # the browser's empty file input: no file chosen
        self._n_file_parts += 1
        if self._n_file_parts > self.max_files:
            self._refuse_one_too_many(original)
            return
        received = ReceivedFile(original_name=original)
        self.files.append(received)
        received.kind = kind_for_filename(received.name)
        if received.kind is None:
            received.refused = (
                f"This type of file is not supported. DocTune reads {SUPPORTED_LABEL}."
            )
            return
        self.dest_dir.mkdir(parents=True, exist_ok=True)
        received.refused = self._disk_full()
        if received.refused:
            return
        final = self.dest_dir / stored_name_for(received.kind, received.name)
        self._part_path = final.with_name(final.name + ".part")
        self._out = open(self._part_path, "xb")  # noqa: SIM115  (closed in on_part_end)
        received.path = final
        self._hash = hashlib.sha256()
        self._current = received
        self._mode = "write"

    def _refuse_one_too_many(self, original: str) -> None:
        """A file past `max_files`: refused by name for as many again, then counted in one
        line (a body of millions of tiny parts must not become millions of rows)."""
        over = self._n_file_parts - self.max_files
        too_many = f"Too many files at once: at most {self.max_files} per upload. "
        if over <= self.max_files:
            self.files.append(ReceivedFile(
                original_name=original, refused=too_many + "Please add this one in another upload."
            ))
            return
        if self._unlisted is None:
            self._unlisted = ReceivedFile(
                original_name="", refused=too_many + "Please add these in other uploads."
            )
            self.files.append(self._unlisted)
        self._unlisted.original_name = f"{over - self.max_files:,} more files"

    # Part body
    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._mode == "field":
            self._field_bytes += end - start
            if self._field_bytes > MAX_FIELD_BYTES:
                raise UploadRejected("This does not look like an upload from the DocTune page.")
            return
        received = self._current
        if self._mode != "write" or received is None or self._out is None:
            return  # a refused file: read past it, keep nothing
        received.size += end - start
        if received.size > self.max_file_bytes:
            self._discard_current()
            limit = human_size(self.max_file_bytes)
            received.refused = f"Too large: the limit is {limit} per file."
            received.size = 0
            self._mode = "skip"
            return
        self._unchecked += end - start
        if self._unchecked > DISK_CHECK_BYTES:
            self._unchecked = 0
            refused = self._disk_full()
            if refused:
                self._discard_current()
                received.refused, received.size, self._mode = refused, 0, "skip"
                return
        chunk = data[start:end]
        self._hash.update(chunk)
        self._out.write(chunk)

    def on_part_end(self) -> None:
        received = self._current
        mode, self._mode = self._mode, "field"
        if mode != "write" or received is None or self._out is None:
            return
        self._out.close()
        self._out = None
        if received.size == 0:
            self._discard_current()
            received.refused = "The file is empty."
            return
        assert self._part_path is not None and received.path is not None
        self._part_path.rename(received.path)
        self._part_path = None
        received.sha256 = self._hash.hexdigest()
        self._current = None

    def on_end(self) -> None:
        pass

    def _disk_full(self) -> str | None:
        """Why this file cannot be written, when the data disk is (nearly) at its margin."""
        free = shutil.disk_usage(self.dest_dir).free
        if free >= self.min_free_bytes + DISK_CHECK_BYTES:
            return None
        return (
            f"Not saved: the disk that holds DocTune's data has only {human_size(free)} free, "
            f"and DocTune keeps {human_size(self.min_free_bytes)} free so that this computer "
            "keeps working. Free some space, then add the file again."
        )

    def _discard_current(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None
        if self._part_path is not None:
            self._part_path.unlink(missing_ok=True)
            self._part_path = None
        if self._current is not None:
            self._current.path = None
            self._current = None

    def cleanup(self) -> None:
        """Delete everything this request wrote (the request as a whole failed)."""
        self._discard_current()
        for received in self.files:
            if received.path is not None:
                received.path.unlink(missing_ok=True)
                received.path = None


def _decode(raw: bytes, charset: str) -> str:
    # parse_options_header hands back the header's bytes as latin-1; browsers send UTF-8.
    try:
        return raw.decode(charset)
    except (UnicodeDecodeError, LookupError):
        return raw.decode("latin-1")


async def receive_files(
    stream: AsyncIterator[bytes],
    content_type: str | None,
    *,
    dest_dir: Path,
    max_file_bytes: int,
    max_files: int,
    min_free_bytes: int | None = None,
) -> list[ReceivedFile]:
    """Parse a multipart/form-data body from `stream`, writing each "files" part under `dest_dir`.

    Returns one ReceivedFile per file part, in order. Raises UploadRejected (nothing left on
    disk) when the body is not a form upload, is malformed or cut off, or grows past
    `max_request_bytes` (also the case for a body sent without a Content-Length). A file that
    would take the disk under `min_free_bytes` (default: DOCTUNE_MIN_FREE_DISK_MB) is refused
    in words, and the files before it are kept."""
    if min_free_bytes is None:
        min_free_bytes = settings.min_free_disk_mb * 1024 * 1024
    ctype, params = parse_options_header(content_type or "")
    if ctype != b"multipart/form-data" or b"boundary" not in params:
        raise UploadRejected("Please send the files with the upload form.", 415)
    charset = params.get(b"charset", b"utf-8").decode("latin-1")
    receiver = _Receiver(dest_dir, max_file_bytes, max_files, charset, min_free_bytes)
    parser = MultipartParser(
        params[b"boundary"],
        {
            "on_part_begin": receiver.on_part_begin,
            "on_part_data": receiver.on_part_data,
            "on_part_end": receiver.on_part_end,
            "on_header_field": receiver.on_header_field,
            "on_header_value": receiver.on_header_value,
            "on_header_end": receiver.on_header_end,
            "on_headers_finished": receiver.on_headers_finished,
            "on_end": receiver.on_end,
        },
    )
    limit = max_request_bytes(max_file_bytes, max_files)
    total = 0
    try:
        async for chunk in stream:
            total += len(chunk)
            if total > limit:
                raise UploadRejected(_too_large_message(max_file_bytes, max_files), 413)
            if chunk:
                # File writes and hashing happen in the callbacks: keep them off the event loop.
                await anyio.to_thread.run_sync(parser.write, chunk)
        parser.finalize()
        if receiver._mode == "write":  # the body ended inside a file part
            raise UploadRejected("The upload was cut off. Please try again.")
    except MultipartParseError as exc:
        receiver.cleanup()
        raise UploadRejected("The upload was cut off or damaged. Please try again.") from exc
    except BaseException:
        receiver.cleanup()
        raise
    return receiver.files


def check_content_length(header: str | None, *, max_file_bytes: int, max_files: int) -> None:
    """Refuse a request whose declared size is over the bound before reading any of it."""
    if header is None:
        return  # chunked: receive_files counts as it reads
    try:
        declared = int(header)
    except ValueError:
        raise UploadRejected("The upload's size header is not a number.") from None
    if declared > max_request_bytes(max_file_bytes, max_files):
        raise UploadRejected(_too_large_message(max_file_bytes, max_files), 413)


def _too_large_message(max_file_bytes: int, max_files: int) -> str:
    return (
        f"This upload is too large. Each file may be up to {human_size(max_file_bytes)}, "
        f"and one upload may hold up to {max_files} files. Nothing was saved."
    )


def receive_local_file(
    src: Path,
    *,
    dest_dir: Path,
    max_file_bytes: int,
    expect: tuple[int, int] | None = None,
    name: str | None = None,
    within: Path | None = None,
) -> ReceivedFile:
    """Copy a file from this machine's disk (CLI, watched folder) the way an upload is received:
    type checked first, copied in chunks while counted and hashed, refused past the limit.

    The file is opened without following a link (`O_NOFOLLOW`) and without waiting
    (`O_NONBLOCK`: a pipe would block a plain open until someone writes to it), then must
    be a regular file and, when `expect` gives (device, inode), the very file the caller
    looked at: a name swapped for another file in between is not read. `name` is the name
    the user knows it by (the link's, when `src` is where a link led). With `within`, the
    file opened must lie under that folder: O_NOFOLLOW guards only the last name of a path,
    so a folder above the file swapped for a link would otherwise lead outside it."""
    shown = name or src.name
    received = ReceivedFile(original_name=shown, kind=kind_for_filename(shown))
    if received.kind is None:
        received.refused = f"This type of file is not supported. DocTune reads {SUPPORTED_LABEL}."
        return received
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            received.refused = (
                "It is a link, which DocTune does not follow here. Put the file itself there."
            )
        else:
            received.refused = f"Could not read the file ({exc.strerror or exc})."
            received.retryable = True
        return received
    with os.fdopen(fd, "rb") as inp:
        st = os.fstat(inp.fileno())
        if within is not None and not _opened_within(inp.fileno(), src, within):
            received.refused = (
                "It is not inside the watched folder: a folder on its way there was replaced "
                "by a link. DocTune does not read it."
            )
            return received
        if not stat.S_ISREG(st.st_mode):
            received.refused = (
                "It is not a regular file (a pipe, device or socket), so DocTune does not read it."
            )
            return received
        if expect is not None and (st.st_dev, st.st_ino) != expect:
            received.refused = (
                "The file was replaced by another one while DocTune was looking at it; it is "
                "looked at again."
            )
            received.retryable = True
            return received
        return _copy_local(inp, received, dest_dir, max_file_bytes)


def _opened_within(fd: int, src: Path, folder: Path) -> bool:
    """Whether the open file `fd` lies under `folder`, by where the kernel says it was
    opened (/proc/self/fd on Linux; elsewhere the path's real path, looked up once more)."""
    try:
        opened = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        opened = os.path.realpath(src)
    root = os.path.realpath(folder).rstrip(os.sep) + os.sep
    return opened.startswith(root)


def _copy_local(
    inp: BinaryIO, received: ReceivedFile, dest_dir: Path, max_file_bytes: int
) -> ReceivedFile:
    """The copying half of `receive_local_file`, from a file already opened and checked."""
    assert received.kind is not None
    dest_dir.mkdir(parents=True, exist_ok=True)
    final = dest_dir / stored_name_for(received.kind, received.name)
    part = final.with_name(final.name + ".part")
    digest = hashlib.sha256()
    try:
        with open(part, "xb") as out:
            while chunk := inp.read(WRITE_CHUNK_BYTES):
                received.size += len(chunk)
                if received.size > max_file_bytes:
                    received.refused = f"Too large: the limit is {human_size(max_file_bytes)} per file."
                    break
                digest.update(chunk)
                out.write(chunk)
    except OSError as exc:
        received.refused = f"Could not read the file ({exc.strerror or exc})."
        received.retryable = True
    if received.refused is None and received.size == 0:
        received.refused = "The file is empty."
    if received.refused is not None:
        part.unlink(missing_ok=True)
        received.size = 0
        return received
    part.rename(final)
    received.path, received.sha256 = final, digest.hexdigest()
    return received
