"""Shared pieces of document extraction: the result type, the one error type, the limits that
keep hostile files from eating the machine, and whitespace normalisation.

`worker.extract` is the front door; the per-format readers (`extract_pdf`, `extract_office`,
`extract_text`, `extract_qa`) import from here.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# Limits. A normal handbook is well under a million characters; these only stop abuse.
MAX_TEXT_CHARS = 20_000_000  # text taken from one file
MAX_TEXT_FILE_BYTES = 100 * 1024 * 1024  # raw size of txt/md/html/csv/jsonl we will decode
MAX_UNZIPPED_BYTES = 500 * 1024 * 1024  # docx/pptx/xlsx: total size once unpacked
MAX_ZIP_MEMBERS = 10_000  # docx/pptx/xlsx: files inside the zip
MAX_SHEET_CELLS = 20_000_000  # xlsx: cells visited, empty ones included
MAX_MARKUP_TAGS = 500_000  # epub/html: "<" in the markup of one file (BeautifulSoup: ~10 µs each)
MAX_XML_TAGS = 2_000_000  # docx/pptx/xlsx/odt/epub: "<" in one XML part (a 500-page report: ~1M)
MAX_ENCODED_WORDS = 1_000  # eml/mbox: "=?" in one header (the parser is quadratic: 25 MB here)

NO_TEXT = "No text found in this document."
NO_TEXT_PDF = "No text found (is it a scanned PDF?)"
TOO_MUCH_TEXT = (
    f"This document holds more than {MAX_TEXT_CHARS:,} characters of text, more than DocTune "
    "takes from one file. Split it into smaller files and upload them separately."
)
UNREADABLE = "Could not read the uploaded file; please upload it again."
TOO_COMPLEX = (
    "This file is too large or complicated to read; split it into smaller files."
)

# "a PDF", "a Word document"...: used in "The file is damaged or not really <label>".
KIND_LABELS: dict[str, str] = {
    "pdf": "a PDF",
    "docx": "a Word document",
    "pptx": "a PowerPoint presentation",
    "xlsx": "an Excel workbook",
    "html": "a web page (HTML)",
    "md": "a Markdown file",
    "txt": "a text file",
    "csv": "a CSV file",
    "jsonl": "a JSONL file",
    "eml": "an e-mail (.eml)",
    "mbox": "a mailbox (.mbox)",
    "epub": "an e-book (EPUB)",
    "odt": "an OpenDocument text (.odt)",
}


class ExtractionError(Exception):
    """A file we can't use. `str(e)` is a plain-words reason meant for the person who uploaded
    it; technical detail goes to the log, never into the message."""


class OutOfMemory(ExtractionError):
    """A reader ran out of memory (MemoryError): in the reader box (`sandbox`) that means the
    file needed more than the box's memory limit, and the message says so."""


def damaged(kind: str) -> ExtractionError:
    """The standard "can't open it" error for a kind."""
    label = KIND_LABELS.get(kind, "a supported document")
    return ExtractionError(f"The file is damaged or not really {label} (could not open it).")


@dataclass
class Extracted:
    """What came out of one file.

    `text` is plain text with paragraphs separated by one blank line. `qa_pairs` are
    (question, answer) pairs; only CSV and JSONL files give them, and `text` is "" then.
    `warnings` are plain-words notes for the user about things that were skipped.
    """

    text: str
    qa_pairs: list[tuple[str, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def word_count(self) -> int:
        """Words in the text plus words in every question and answer."""
        words = len(self.text.split())
        return words + sum(len(q.split()) + len(a.split()) for q, a in self.qa_pairs)

    def preview(self, n_chars: int = 300) -> str:
        """The first `n_chars` characters (cut at a word, "…" added when cut); for Q&A files
        the first pairs written as "Q: ... / A: ..."."""
        if n_chars <= 0:
            return ""
        source = self.text
        if not source:
            parts: list[str] = []
            size = 0
            for q, a in self.qa_pairs:
                parts.append(f"Q: {q}\nA: {a}")
                size += len(parts[-1]) + 2
                if size > n_chars:
                    break
            source = "\n\n".join(parts)
        if len(source) <= n_chars:
            return source
        cut = source[:n_chars]
        if not source[n_chars].isspace() and re.search(r"\s", cut):
            cut = re.sub(r"\s+\S*$", "", cut)  # don't end mid-word
        return cut.rstrip() + "…"


class TextBudget:
    """Counts characters as a reader produces them, so a huge file fails early instead of
    filling memory first."""

    def __init__(self, limit: int = MAX_TEXT_CHARS) -> None:
        self.limit = limit
        self.used = 0

    def add(self, text: str) -> str:
        self.used += len(text)
        if self.used > self.limit:
            raise ExtractionError(TOO_MUCH_TEXT)
        return text


@dataclass
class ReadContext:
    """What a reader gets besides its file: the text budget it spends, how deep in attached
    files the read is, and the front door (`extract_nested(path, kind, depth)`) to read an
    attached file with the reader of its own type, under the same checks (so no reader
    imports the dispatcher)."""

    budget: TextBudget
    extract_nested: Callable[[Path, str, int], Extracted]
    depth: int = 0


def check_markup(data: bytes) -> None:
    """Refuse markup with more tags than any real page or chapter (a million empty <p> is
    3.7 KB deflated and costs BeautifulSoup 10 s and half a GB); counted before parsing."""
    if data.count(b"<") > MAX_MARKUP_TAGS:
        raise ExtractionError(too_much_markup(MAX_MARKUP_TAGS))


def too_much_markup(limit: int) -> str:
    """The refusal for a part with more than `limit` tags, in words."""
    return (
        f"This file holds more than {limit:,} pieces of markup in one part, far more than a "
        "real document; DocTune refuses it to protect the computer. If it is genuine, split "
        "it into smaller files."
    )


TOO_DEEP = (
    "This file nests its parts inside each other thousands of levels deep, as files built to "
    "crash programs do; DocTune refuses it to protect the computer. If it is genuine, open it "
    "and save it again, then upload the copy."
)


def nested_too_deep(exc: BaseException) -> bool:
    """Whether a reader's failure (or what caused it) is a nesting limit: Python's recursion
    limit, or libxml2's "Excessive depth" (256 levels unless told otherwise)."""
    seen = 0
    while exc is not None and seen < 20:
        if isinstance(exc, RecursionError) or "Excessive depth" in str(exc):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def read_limited(path: Path) -> bytes:
    """Read a text-type file, refusing ones too big to be worth decoding."""
    if path.stat().st_size > MAX_TEXT_FILE_BYTES:
        raise ExtractionError(TOO_MUCH_TEXT)
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ExtractionError(UNREADABLE) from exc


# --- whitespace normalisation -------------------------------------------------------------

_LIGATURES = str.maketrans(
    {"ﬀ": "ff", "ﬁ": "fi", "ﬂ": "fl", "ﬃ": "ffi", "ﬄ": "ffl", "ﬅ": "st", "ﬆ": "st"}
)
# Line-ish separators become newlines; U+2029 is a paragraph separator.
_LINE_BREAKS = re.compile(r"\r\n?|[\x0b\x0c\x1c-\x1e\x85\u2028]")
# Invisible characters (soft hyphen, zero-width space/joiners, word joiner, BOM) and C0/C1
# control characters other than tab and newline.
_INVISIBLE = re.compile(r"[\x00-\x08\x0e-\x1f\x7f-\x9f\u00ad\u200b-\u200d\u2060\ufeff]")
_HSPACE = re.compile(r"[^\S\n]+")  # any whitespace but newline: tabs, NBSP, thin spaces...
_EDGE_SPACE = re.compile(r" ?\n ?")
_BLANKS = re.compile(r"\n{3,}")


def normalize_text(text: str) -> str:
    """Tidy extracted text: NFC, no ligatures or invisible characters, runs of spaces and tabs
    collapsed to one space, lines stripped, and paragraphs separated by exactly one blank line.
    Single line breaks inside a paragraph are kept (lists, addresses)."""
    text = unicodedata.normalize("NFC", text).translate(_LIGATURES)
    text = _LINE_BREAKS.sub("\n", text).replace("\u2029", "\n\n")
    text = _INVISIBLE.sub("", text)
    text = _HSPACE.sub(" ", text)
    text = _EDGE_SPACE.sub("\n", text)
    text = _BLANKS.sub("\n\n", text)
    return text.strip()


def normalize_inline(text: str) -> str:
    """Like `normalize_text` but all on one line (table cells, spreadsheet values)."""
    return " ".join(normalize_text(text).split())
