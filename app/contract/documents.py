"""Where the reader leaves a document's extracted text, beside its stored original: both the
worker (which writes them) and the web app (which reads them for the chat's passages) name
the files with these."""

from __future__ import annotations

from pathlib import Path


def text_file(documents_dir: Path, stored_name: str) -> Path:
    """The document's extracted text, UTF-8."""
    return Path(documents_dir) / f"{stored_name}.txt"


def qa_file(documents_dir: Path, stored_name: str) -> Path:
    """Its question-answer pairs as a JSON list of [question, answer]."""
    return Path(documents_dir) / f"{stored_name}.qa.json"
