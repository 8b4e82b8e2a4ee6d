"""PDF text with pypdf, with paragraphs put back together.

pypdf gives one line of text per printed line and no paragraph marks. We ask it for each
text fragment's position as well, and start a new paragraph where the gap between two lines is
clearly bigger than the usual line spacing, where the font size changes (headings), or where
the text jumps up the page (a new column). Lines inside a paragraph are joined with a space.
"""

from __future__ import annotations

import logging
import math
import re
from collections import Counter
from pathlib import Path

from worker.extract.common import Extracted, ExtractionError, ReadContext, damaged

log = logging.getLogger(__name__)

PASSWORD_PDF = "This PDF is password-protected; remove the password and upload it again."
UNSUPPORTED_ENCRYPTION = (
    "This PDF is locked with a kind of encryption DocTune can't open; save an unlocked "
    'copy (for example with "Print to PDF") and upload that.'
)

# A line starting like a list item keeps its own line instead of joining the one above.
_LIST_ITEM = re.compile(r"^(?:[•◦▪▫●○■□‣⁃∙·*–—-]\s|\(?\d{1,3}[.)]\s|\(?[a-zA-Z][.)]\s)")


def extract_pdf(path: Path, ctx: ReadContext) -> Extracted:
    """Text of every page, pages and paragraphs separated by blank lines."""
    budget = ctx.budget
    from pypdf import PdfReader
    from pypdf.errors import DependencyError

    with open(path, "rb") as f:
        head = f.read(1024)
    if b"%PDF" not in head:
        raise damaged("pdf")
    try:
        reader = PdfReader(path, strict=False)
    except DependencyError as exc:
        log.warning("pypdf could not open %s: %s", path, exc)
        raise ExtractionError(UNSUPPORTED_ENCRYPTION) from exc

    if reader.is_encrypted:
        # Many PDFs carry only an "owner" password (no copying/printing) and open with an
        # empty user password; those we can read.
        try:
            result = reader.decrypt("")
        except (DependencyError, NotImplementedError) as exc:
            log.warning("cannot decrypt %s: %s", path, exc)
            raise ExtractionError(UNSUPPORTED_ENCRYPTION) from exc
        if not result:  # PasswordType.NOT_DECRYPTED is 0
            raise ExtractionError(PASSWORD_PDF)

    n_pages = len(reader.pages)
    if n_pages == 0:
        raise damaged("pdf")

    pages: list[str] = []
    failed = 0
    # Pages that share their content stream are read once (None: that read failed).
    seen: dict[tuple, str | None] = {}
    for number in range(n_pages):
        key = None
        try:
            page = reader.pages[number]
            key = _content_key(page)
            if key is not None and key in seen:
                text = seen[key]
                if text is None:
                    failed += 1
                    continue
            else:
                text = _page_text(page)
                if key is not None:
                    seen[key] = text
        except ExtractionError:
            raise
        except Exception:  # one bad page should not cost the whole document
            log.warning("pypdf failed on page %d of %s", number + 1, path, exc_info=True)
            failed += 1
            if key is not None:
                seen[key] = None
            continue
        pages.append(budget.add(text))

    if failed == n_pages:
        raise damaged("pdf")
    warnings = []
    if failed:
        warnings.append(f"Could not read the text on {failed} of {n_pages} pages.")
    return Extracted(text="\n\n".join(pages), warnings=warnings)


def _content_key(page) -> tuple | None:
    """What makes a page's text: its content streams and resources, by object number. Pages
    with the same key print the same text, so a PDF whose 20 pages share one 2 MB content
    stream (5.6 KB on disk, a minute of pypdf's time) is parsed once. None: not shareable
    (direct objects), read as usual."""
    from pypdf.generic import ArrayObject, IndirectObject

    contents = page.raw_get("/Contents") if "/Contents" in page else None
    if isinstance(contents, IndirectObject):
        refs = [contents]
        resolved = contents.get_object()
        if isinstance(resolved, ArrayObject):
            refs = list.__iter__(resolved)
    elif isinstance(contents, ArrayObject):
        refs = list.__iter__(contents)
    else:
        return None
    streams = []
    for ref in refs:
        if not isinstance(ref, IndirectObject):
            return None
        streams.append((ref.idnum, ref.generation))
    resources = page.raw_get("/Resources") if "/Resources" in page else None
    if isinstance(resources, IndirectObject):
        where: object = (resources.idnum, resources.generation)
    elif resources is None:  # inherited from the page tree
        parent = page.raw_get("/Parent") if "/Parent" in page else None
        if not isinstance(parent, IndirectObject):
            return None
        where = ("parent", parent.idnum, parent.generation)
    else:  # a direct dictionary: small, and its repr names the objects it uses
        where = repr(resources)
    return (tuple(streams), where)


def _page_text(page) -> str:
    fragments: list[tuple[str, float, float]] = []

    def visit(text: str, cm: list, tm: list, font_dict: object, font_size: float) -> None:
        if text:
            m = _multiply(tm, cm)
            scale = math.hypot(m[2], m[3]) or 1.0
            fragments.append((text, m[5], abs(font_size * scale)))

    plain = page.extract_text(visitor_text=visit)
    if "".join(f[0] for f in fragments) != plain:
        # The positions don't cover the whole text (unusual PDF): keep pypdf's own lines.
        return plain
    return _paragraphs(_lines(fragments))


def _multiply(a: list, b: list) -> tuple[float, ...]:
    """Product of two PDF matrices [a b c d e f] (a applied first)."""
    return (
        a[0] * b[0] + a[1] * b[2],
        a[0] * b[1] + a[1] * b[3],
        a[2] * b[0] + a[3] * b[2],
        a[2] * b[1] + a[3] * b[3],
        a[4] * b[0] + a[5] * b[2] + b[4],
        a[4] * b[1] + a[5] * b[3] + b[5],
    )


def _lines(fragments: list[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    """Split the fragments at pypdf's newlines into (text, baseline y, font size) lines; a
    line's position is that of its first visible fragment."""
    lines: list[tuple[str, float, float]] = []
    parts: list[str] = []
    where: tuple[float, float] | None = None
    for text, y, size in fragments:
        pieces = text.split("\n")
        for i, piece in enumerate(pieces):
            if where is None and piece.strip():
                where = (y, size)
            parts.append(piece)
            if i < len(pieces) - 1:
                lines.append(("".join(parts), *(where or (y, size))))
                parts, where = [], None
    if parts:
        lines.append(("".join(parts), *(where or (0.0, 0.0))))
    return lines


def _same_size(a: float, b: float) -> bool:
    return abs(a - b) <= 0.12 * max(a, b, 1.0)


def _line_pitches(lines: list[tuple[str, float, float]]) -> dict[float, float]:
    """The usual distance between consecutive lines, per font size: the most common gap
    (ties to the smaller), capped at 1.45x the size so that a page of one-line paragraphs
    still breaks between them."""
    gaps: dict[float, Counter[float]] = {}
    prev: tuple[float, float] | None = None
    for text, y, size in lines:
        if not text.strip():
            prev = None
            continue
        if prev is not None and _same_size(prev[1], size):
            dy = prev[0] - y
            if dy > 0.5 * size:
                gaps.setdefault(round(size, 1), Counter())[round(dy * 2) / 2] += 1
        prev = (y, size)
    pitches = {}
    for size, counter in gaps.items():
        top = max(counter.values())
        common = min(gap for gap, n in counter.items() if n == top)
        pitches[size] = min(common, 1.45 * size)
    return pitches


def _paragraphs(lines: list[tuple[str, float, float]]) -> str:
    pitches = _line_pitches(lines)
    paragraphs: list[str] = []
    current = ""
    prev: tuple[float, float] | None = None
    for text, y, size in lines:
        line = " ".join(text.split())
        if not line:
            if current:
                paragraphs.append(current)
            current, prev = "", None
            continue
        if current and prev is not None:
            dy = prev[0] - y
            pitch = pitches.get(round(size, 1), 1.2 * size)
            new_paragraph = (
                not _same_size(prev[1], size)
                or dy < -0.5 * size  # jumped up: a new column or box
                or dy > 1.2 * pitch + 0.5
            )
            if new_paragraph:
                paragraphs.append(current)
                current = line
            elif dy < 0.5 * size:  # same baseline (or a sub/superscript): same line
                current += " " + line
            elif _LIST_ITEM.match(line):
                current += "\n" + line
            elif current.endswith("-") and current[-2:-1].isalnum():
                current += line  # "NW-" + "4471", "well-" + "known": keep the hyphen
            else:
                current += " " + line
        else:
            current = line
        prev = (y, size)
    if current:
        paragraphs.append(current)
    return "\n\n".join(paragraphs)
