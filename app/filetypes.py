"""Which uploads DocTune reads, decided from the file name alone.

Pure standard library on purpose: the web app checks names before it accepts an upload, and
the app must never pull in the worker's parsing (or ML) libraries. `worker.extract` re-exports
these names and does the actual reading.
"""

from __future__ import annotations

# File extension (lower case, no dot) -> the kind of reader `worker.extract.extract` uses.
SUPPORTED_KINDS: dict[str, str] = {
    "pdf": "pdf",
    "docx": "docx",
    "pptx": "pptx",
    "xlsx": "xlsx",
    "xlsm": "xlsx",  # macro-enabled workbook: same format, macros are never run
    "html": "html",
    "htm": "html",
    "xhtml": "html",
    "md": "md",
    "markdown": "md",
    "mdown": "md",
    "mkd": "md",
    "txt": "txt",
    "text": "txt",
    "csv": "csv",
    "tsv": "csv",  # the CSV reader works out the separator itself
    "jsonl": "jsonl",
    "ndjson": "jsonl",
    "eml": "eml",
    "mbox": "mbox",
    "epub": "epub",
    "odt": "odt",
}

# For messages such as "DocTune reads PDF, Word (.docx), ...".
SUPPORTED_LABEL = (
    "PDF, Word (.docx), PowerPoint (.pptx), Excel (.xlsx), OpenDocument text (.odt), "
    "e-books (.epub), e-mail (.eml, .mbox), HTML, Markdown, plain text, "
    "CSV or JSONL of question-answer pairs"
)

# For an upload form's <input type="file" accept="...">.
ACCEPT_ATTRIBUTE = ",".join(f".{ext}" for ext in SUPPORTED_KINDS)


def kind_for_filename(name: str) -> str | None:
    """Return the reader kind for an uploaded file's name, or None when DocTune can't read it.

    Only the last extension counts ("x.tar.gz" -> "gz" -> None), any folder part a browser or
    an attacker put in the name is ignored, and a name that is nothing but an extension
    (".pdf") has no extension, as with pathlib.
    """
    base = name.replace("\\", "/").rsplit("/", 1)[-1].strip()
    stem, dot, ext = base.rpartition(".")
    if not dot or not stem.strip("."):
        return None
    return SUPPORTED_KINDS.get(ext.strip().lower())
