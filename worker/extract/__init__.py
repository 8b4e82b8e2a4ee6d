"""Reading documents: one reader per format (`pdf`, `office`, `epub_odt`, `mail`, `text`,
`qa`), the checks and limits they share (`common`), the front door that picks the reader
and turns every failure into a message for the user (`dispatch.extract`), and the box that
runs it in a child process under memory, CPU and wall-clock limits (`sandbox.extract_boxed`,
what the ingest task uses)."""

from app.filetypes import SUPPORTED_KINDS, SUPPORTED_LABEL, kind_for_filename
from worker.extract.common import Extracted, ExtractionError
from worker.extract.dispatch import extract

__all__ = [
    "SUPPORTED_KINDS",
    "SUPPORTED_LABEL",
    "Extracted",
    "ExtractionError",
    "extract",
    "kind_for_filename",
]
