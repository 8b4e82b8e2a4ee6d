"""Open formats in zip archives: e-books (EPUB) and OpenDocument text (ODT, LibreOffice).

Both get the same zip-bomb check as Office files before anything is unpacked. EPUB is read
with zipfile, defusedxml (for its package files) and BeautifulSoup on lxml's HTML parser (for
its chapters, in reading order); ODT with odfpy, whose SAX parser fetches no external
entities. Copy-protected e-books and password-protected ODT files are refused by name.
"""

from __future__ import annotations

import logging
import posixpath
import zipfile
from pathlib import Path
from urllib.parse import unquote

from worker.extract.common import (
    Extracted,
    ExtractionError,
    ReadContext,
    TextBudget,
    check_markup,
    damaged,
    normalize_inline,
)
from worker.extract.office import check_zip
from worker.extract.text import html_to_text

log = logging.getLogger(__name__)

_OLE_MAGIC = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"
_CONTAINER = "{urn:oasis:names:tc:opendocument:xmlns:container}"
_OPF = "{http://www.idpf.org/2007/opf}"
_ENC = "{http://www.w3.org/2001/04/xmlenc#}"
_HTML_TYPES = ("application/xhtml+xml", "text/html")

DRM = (
    "This e-book is copy-protected (DRM), so its text cannot be read. Use a copy without "
    "protection, or save the text as PDF or Word."
)
ODT_PASSWORD = (
    "This document is password-protected. Open it in LibreOffice, remove the password "
    "(File > Properties > Security, or Save As without a password) and add it again."
)


def _check_archive(path: Path, kind: str) -> None:
    with open(path, "rb") as fh:
        head = fh.read(8)
    if head.startswith(_OLE_MAGIC):  # an old .doc renamed, say: not an archive at all
        raise damaged(kind)
    check_zip(path, kind)


# --- EPUB ---------------------------------------------------------------------------------


def extract_epub(path: Path, ctx: ReadContext) -> Extracted:
    """The book's chapters in reading order (the spine), each read like a web page."""
    budget = ctx.budget
    _check_archive(path, "epub")
    from bs4 import BeautifulSoup

    with zipfile.ZipFile(path) as zf:
        names = set(zf.namelist())
        chapters = _spine(zf, names)
        protected = _encrypted(zf, names)
        if protected & set(chapters):
            raise ExtractionError(DRM)
        blocks = []
        for name in chapters:
            markup = zf.read(name)
            check_markup(markup)
            text = html_to_text(BeautifulSoup(markup, "lxml")).strip()
            if text:
                blocks.append(budget.add(text))
    return Extracted(text="\n\n".join(blocks))


def _xml(zf: zipfile.ZipFile, name: str):
    from defusedxml import ElementTree

    return ElementTree.fromstring(zf.read(name))


def _spine(zf: zipfile.ZipFile, names: set[str]) -> list[str]:
    """Chapter file names in reading order: container.xml -> package (.opf) -> spine. A book
    whose package cannot be found is read from its HTML files in name order."""
    opf = None
    if "META-INF/container.xml" in names:
        try:
            root = _xml(zf, "META-INF/container.xml")
            for rootfile in root.iter(f"{_CONTAINER}rootfile"):
                if rootfile.get("full-path") in names:
                    opf = rootfile.get("full-path")
                    break
        except Exception:  # noqa: BLE001  (broken container: fall back below)
            log.info("unreadable container.xml in an EPUB; guessing its chapters")
    if opf is None:
        opf = next((n for n in sorted(names) if n.lower().endswith(".opf")), None)
    chapters: list[str] = []
    if opf is not None:
        try:
            package = _xml(zf, opf)
        except Exception:  # noqa: BLE001
            package = None
        if package is not None:
            base = posixpath.dirname(opf)
            items = {}
            for item in package.iter(f"{_OPF}item"):
                href = unquote((item.get("href") or "").split("#", 1)[0])
                full = posixpath.normpath(posixpath.join(base, href)) if href else ""
                items[item.get("id")] = (
                    full,
                    item.get("media-type", ""),
                    item.get("properties") or "",
                )
            for ref in package.iter(f"{_OPF}itemref"):
                full, media, props = items.get(ref.get("idref"), ("", "", ""))
                if (
                    full in names
                    and media in _HTML_TYPES
                    and "nav" not in props.split()
                    and full not in chapters
                ):
                    chapters.append(full)
    if not chapters:
        chapters = sorted(n for n in names if n.lower().endswith((".xhtml", ".html", ".htm")))
    if not chapters:
        raise ExtractionError("No chapters were found in this e-book.")
    return chapters


def _encrypted(zf: zipfile.ZipFile, names: set[str]) -> set[str]:
    """Files listed as encrypted (fonts are often "obfuscated" this way; chapters mean DRM)."""
    if "META-INF/encryption.xml" not in names:
        return set()
    try:
        root = _xml(zf, "META-INF/encryption.xml")
    except Exception:  # noqa: BLE001
        return set()
    return {unquote(ref.get("URI", "")) for ref in root.iter(f"{_ENC}CipherReference")}


# --- ODT ----------------------------------------------------------------------------------

_TEXT = "urn:oasis:names:tc:opendocument:xmlns:text:1.0"
_TABLE = "urn:oasis:names:tc:opendocument:xmlns:table:1.0"
_PARAGRAPHS = {(_TEXT, "p"), (_TEXT, "h")}
_SKIP = {
    (_TEXT, "tracked-changes"),
    (_TEXT, "sequence-decls"),
    (_TEXT, "variable-decls"),
    (_TEXT, "user-field-decls"),
    (_TABLE, "table-columns"),
    (_TABLE, "table-column"),
}


def extract_odt(path: Path, ctx: ReadContext) -> Extracted:
    """Headings, paragraphs, lists and tables in document order (a table row becomes one
    line with its cells joined by " | "); tracked deletions are left out."""
    budget = ctx.budget
    _check_archive(path, "odt")
    with zipfile.ZipFile(path) as zf:
        names = set(zf.namelist())
        if "content.xml" not in names:
            raise damaged("odt")
        if "META-INF/manifest.xml" in names and b"encryption-data" in zf.read(
            "META-INF/manifest.xml"
        ):
            raise ExtractionError(ODT_PASSWORD)
    from odf.opendocument import load

    document = load(str(path))
    blocks: list[str] = []
    _odt_blocks(document.text, blocks, budget)
    return Extracted(text="\n\n".join(blocks))


def _odt_blocks(container, out: list[str], budget: TextBudget) -> None:
    from odf import teletype

    for child in container.childNodes:
        qname = getattr(child, "qname", None)
        if qname is None or qname in _SKIP:
            continue
        if qname in _PARAGRAPHS:
            text = teletype.extractText(child)
            if text.strip():
                out.append(budget.add(text))
        elif qname == (_TABLE, "table"):
            lines = []
            for row in _odt_rows(child):
                cells = []
                for cell in row.childNodes:
                    if getattr(cell, "qname", None) == (_TABLE, "table-cell"):
                        inner: list[str] = []
                        _odt_blocks(cell, inner, budget)
                        if text := normalize_inline(" ".join(inner)):
                            cells.append(text)
                if cells:
                    lines.append(" | ".join(cells))
            if lines:
                out.append("\n".join(lines))
        else:  # lists, list items, sections, indexes, frames: read what they hold
            _odt_blocks(child, out, budget)


def _odt_rows(table):
    for child in table.childNodes:
        qname = getattr(child, "qname", None)
        if qname == (_TABLE, "table-row"):
            yield child
        elif qname in (
            (_TABLE, "table-header-rows"),
            (_TABLE, "table-rows"),
            (_TABLE, "table-row-group"),
        ):
            yield from _odt_rows(child)
