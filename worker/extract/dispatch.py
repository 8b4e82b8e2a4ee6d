"""Turn an uploaded document into plain text (or question-answer pairs).

The front door of document extraction: `extract(path, kind)` reads one file with a
well-kept library per format and returns an `Extracted`; every problem with the file comes
out as an `ExtractionError` whose message an office worker can act on. The readers live in
`pdf`, `office` (DOCX, PPTX, XLSX), `epub_odt`, `mail` (EML, MBOX), `text` (TXT, HTML,
Markdown) and `qa` (CSV, JSONL), take the file and a `ReadContext` (a reader of mail reads
its attachments through the context, never by importing this module), and import their
parsing libraries only when called, so importing this module stays cheap. The file-name rules
(`SUPPORTED_KINDS`, `kind_for_filename`) belong to `app.filetypes`, shared with the web app.
"""

from __future__ import annotations

import logging
import stat
from collections.abc import Callable
from pathlib import Path

from app.filetypes import SUPPORTED_LABEL
from worker.extract.common import (
    MAX_TEXT_CHARS,
    NO_TEXT,
    NO_TEXT_PDF,
    TOO_COMPLEX,
    TOO_DEEP,
    TOO_MUCH_TEXT,
    UNREADABLE,
    Extracted,
    ExtractionError,
    OutOfMemory,
    ReadContext,
    TextBudget,
    damaged,
    nested_too_deep,
    normalize_text,
)
from worker.extract.epub_odt import extract_epub, extract_odt
from worker.extract.mail import extract_eml, extract_mbox
from worker.extract.office import extract_docx, extract_pptx, extract_xlsx
from worker.extract.pdf import extract_pdf
from worker.extract.qa import extract_csv, extract_jsonl
from worker.extract.text import extract_html, extract_md, extract_txt

log = logging.getLogger(__name__)

_READERS: dict[str, Callable[[Path, ReadContext], Extracted]] = {
    "pdf": extract_pdf,
    "docx": extract_docx,
    "pptx": extract_pptx,
    "xlsx": extract_xlsx,
    "html": extract_html,
    "md": extract_md,
    "txt": extract_txt,
    "csv": extract_csv,
    "jsonl": extract_jsonl,
    "eml": extract_eml,
    "mbox": extract_mbox,
    "epub": extract_epub,
    "odt": extract_odt,
}


def extract(path: Path, kind: str, depth: int = 0) -> Extracted:
    """Read `path` as `kind` (a value of SUPPORTED_KINDS) and return its normalised text, or
    its question-answer pairs for csv/jsonl. Raises ExtractionError, and nothing else, for
    any file that can't be used; the technical cause is logged. `depth`: how deep in
    attached files this one is (0 for an uploaded file)."""
    reader = _READERS.get(kind) if isinstance(kind, str) else None
    if reader is None:
        raise ExtractionError(f"DocTune can't read this type of file. It reads {SUPPORTED_LABEL}.")
    try:
        path = Path(path)
        info = path.stat()
    except (OSError, TypeError, ValueError) as exc:
        log.warning("cannot stat %r: %s", path, exc)
        raise ExtractionError(UNREADABLE) from exc
    if not stat.S_ISREG(info.st_mode):
        raise ExtractionError(UNREADABLE)
    if info.st_size == 0:
        raise ExtractionError(NO_TEXT)

    try:
        raw = reader(path, ReadContext(TextBudget(), extract, depth))
    except ExtractionError as exc:
        log.info("extraction refused %s (%s): %s", path, kind, exc)
        raise
    except ImportError as exc:  # a broken install, not a broken file: say so
        log.exception("a reader library for %s files is missing", kind)
        raise ExtractionError(
            "DocTune is missing a part it needs to read this kind of file; please tell "
            "whoever installed DocTune."
        ) from exc
    except MemoryError as exc:
        log.warning("out of memory reading %s (%s)", path, kind)
        raise OutOfMemory(TOO_COMPLEX) from exc
    except Exception as exc:  # any library failure means a file we can't open
        if nested_too_deep(exc):
            log.warning("refusing %s (%s): nested too deep", path, kind)
            raise ExtractionError(TOO_DEEP) from exc
        log.warning("failed to read %s as %s", path, kind, exc_info=True)
        raise damaged(kind) from exc
    return _finish(raw, kind)


def _finish(raw: Extracted, kind: str) -> Extracted:
    text = normalize_text(raw.text) if raw.text else ""
    if len(text) > MAX_TEXT_CHARS:
        raise ExtractionError(TOO_MUCH_TEXT)
    if not text and not raw.qa_pairs:
        raise ExtractionError(NO_TEXT_PDF if kind == "pdf" else NO_TEXT)
    return Extracted(text=text, qa_pairs=list(raw.qa_pairs), warnings=list(raw.warnings))
