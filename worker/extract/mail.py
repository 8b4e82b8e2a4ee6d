"""E-mail: single messages (.eml) and mailboxes (.mbox), with the standard library's `email`
and `mailbox` packages.

Each message becomes its headers that matter (subject, from, to, date), its body (the plain
text part, else the HTML part read like a web page) and the text of its attachments, each
read by DocTune's reader for that type (a PDF by the PDF reader, a forwarded message by this
one, at most MAX_DEPTH deep). An attachment that cannot be read is noted in the warnings and
the rest of the message is kept.
"""

from __future__ import annotations

import logging
import tempfile
from email import policy
from email.message import EmailMessage
from email.parser import BytesParser
from pathlib import Path

from app.filetypes import kind_for_filename
from worker.extract.common import (
    MAX_ENCODED_WORDS,
    MAX_TEXT_FILE_BYTES,
    Extracted,
    ExtractionError,
    ReadContext,
    read_limited,
)
from worker.extract.text import check_mostly_text, check_not_other_format, html_to_text

log = logging.getLogger(__name__)

MAX_DEPTH = 3  # a message attached to a message attached to a message
MAX_MESSAGES = 100_000  # messages read from one mailbox
_HEADERS = ("subject", "from", "to", "cc", "date")
NOT_MAIL = "This does not look like an e-mail file: it has no message headers."


def extract_eml(path: Path, ctx: ReadContext) -> Extracted:
    data = read_limited(path)
    check_not_other_format(data)
    message = BytesParser(policy=policy.default).parsebytes(data)
    check_headers(message)
    if not _looks_like_mail(message):
        raise ExtractionError(NOT_MAIL)
    out = Extracted(text="")
    out.text = _message_text(message, ctx, out, depth=ctx.depth)
    check_mostly_text(out.text)
    return out


def extract_mbox(path: Path, ctx: ReadContext) -> Extracted:
    """Every message of a Unix mailbox (Thunderbird, Apple Mail export, Google Takeout)."""
    import mailbox

    if path.stat().st_size > 50 * MAX_TEXT_FILE_BYTES:
        raise ExtractionError(
            "This mailbox is too large to read at once; export it in smaller parts."
        )
    with open(path, "rb") as fh:
        head = fh.read(5)
    if head != b"From ":
        raise ExtractionError(
            "This does not look like a mailbox (.mbox) file: it should start with a “From ” "
            "line. Export the mailbox again, or save single messages as .eml."
        )
    box = mailbox.mbox(str(path), factory=None, create=False)
    out = Extracted(text="")
    parts: list[str] = []
    try:
        for n, key in enumerate(box.iterkeys()):
            if n >= MAX_MESSAGES:
                out.warnings.append(f"Only the first {MAX_MESSAGES:,} messages were read.")
                break
            raw = box.get_bytes(key)
            message = BytesParser(policy=policy.default).parsebytes(raw)
            text = _message_text(message, ctx, out, depth=ctx.depth)
            if text:
                parts.append(text)
    finally:
        box.close()
    if not parts:
        raise ExtractionError("No messages with text were found in this mailbox.")
    out.text = "\n\n".join(parts)
    check_mostly_text(out.text)
    return out


TOO_MANY_ENCODED_WORDS = (
    f"A header of this e-mail holds more than {MAX_ENCODED_WORDS:,} encoded pieces "
    "(“=?...?=”), far more than a real message; DocTune refuses it to protect the computer. "
    "Forward the message to yourself, save the copy and upload that."
)


def check_headers(message: EmailMessage) -> None:
    """Count RFC 2047 encoded words in each raw header before any is parsed: the standard
    library's header parser is quadratic in them (10,000 in a Subject: a GB; 1,000: 25 MB).
    The raw values are what the parser has not touched yet, so counting costs nothing."""
    for _name, value in message.raw_items():
        if str(value).count("=?") > MAX_ENCODED_WORDS:
            raise ExtractionError(TOO_MANY_ENCODED_WORDS)


def _looks_like_mail(message: EmailMessage) -> bool:
    return any(message.get(h) for h in (*_HEADERS, "message-id", "mime-version"))


def _header(message: EmailMessage, name: str) -> str:
    try:
        value = message.get(name)
    except Exception:  # noqa: BLE001  (a malformed header is skipped, not fatal)
        return ""
    return " ".join(str(value).split()) if value else ""


def _message_text(message: EmailMessage, ctx: ReadContext, out: Extracted, depth: int) -> str:
    check_headers(message)  # each message of a mailbox, and each attached one
    lines = [
        f"{name.capitalize()}: {value}" for name in _HEADERS if (value := _header(message, name))
    ]
    blocks = ["\n".join(lines)] if lines else []
    body = _body(message)
    if body:
        blocks.append(body)
    for part in _attachments(message):
        blocks.extend(_attachment_text(part, ctx, out, depth))
    return ctx.budget.add("\n\n".join(b for b in blocks if b.strip()))


def _body(message: EmailMessage) -> str:
    try:
        part = message.get_body(preferencelist=("plain", "html"))
    except Exception:  # noqa: BLE001
        part = None
    if part is None:
        return ""
    content = _content(part)
    if not isinstance(content, str):
        return ""
    if part.get_content_subtype() == "html":
        from bs4 import BeautifulSoup

        return html_to_text(BeautifulSoup(content, "lxml"))
    return content


def _content(part: EmailMessage) -> object:
    """The decoded content; a part in an unknown character set is read as UTF-8."""
    try:
        return part.get_content()
    except (LookupError, UnicodeDecodeError, ValueError, AssertionError):
        payload = part.get_payload(decode=True)
        return payload.decode("utf-8", "replace") if isinstance(payload, bytes) else ""


def _attachments(message: EmailMessage):
    try:
        yield from message.iter_attachments()
    except Exception:  # noqa: BLE001  (not multipart, or broken structure: no attachments)
        return


def _attachment_text(
    part: EmailMessage, ctx: ReadContext, out: Extracted, depth: int
) -> list[str]:
    name = part.get_filename() or ""
    if part.get_content_type() == "message/rfc822":
        inner = _content(part)
        if depth + 1 >= MAX_DEPTH or not isinstance(inner, EmailMessage):
            return []
        text = _message_text(inner, ctx, out, depth + 1)
        return [f"Attached message:\n{text}"] if text else []
    kind = kind_for_filename(name) if name else None
    if kind is None:
        if name and part.get_content_maintype() != "image":
            out.warnings.append(f"Attachment “{name}” skipped: DocTune does not read that type.")
        return []
    if kind in ("eml", "mbox") and depth + 1 >= MAX_DEPTH:
        return []
    payload = part.get_payload(decode=True)
    if not isinstance(payload, bytes) or not payload:
        return []
    with tempfile.TemporaryDirectory(prefix="doctune-mail-") as tmp:
        file = Path(tmp) / f"attachment.{name.rsplit('.', 1)[-1].lower()}"
        file.write_bytes(payload)
        try:  # the reader of its own type, one level deeper
            inner = ctx.extract_nested(file, kind, depth + 1)
        except ExtractionError as exc:
            out.warnings.append(f"Attachment “{name}” could not be read: {exc}")
            return []
    out.qa_pairs.extend(inner.qa_pairs)
    out.warnings.extend(f"Attachment “{name}”: {w}" for w in inner.warnings)
    return [ctx.budget.add(f"Attachment: {name}\n\n{inner.text}")] if inner.text else []
