"""Plain text, HTML and Markdown, plus decoding text files of unknown encoding.

HTML goes through BeautifulSoup on lxml's HTML parser (which never expands DTD entities);
Markdown is rendered to HTML by markdown-it-py and then read the same way, so both give
headings, paragraphs and list items as separate paragraphs.
"""

from __future__ import annotations

import codecs
import logging
import re
from pathlib import Path

from worker.extract.common import (
    Extracted,
    ExtractionError,
    ReadContext,
    check_markup,
    read_limited,
)

log = logging.getLogger(__name__)

NOT_TEXT = (
    "This does not look like a text file (it is mostly unreadable characters). "
    "Upload the original document instead."
)

_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32-le"),  # before UTF-16 LE: it starts with the same bytes
    (codecs.BOM_UTF32_BE, "utf-32-be"),
    (codecs.BOM_UTF8, "utf-8"),
    (codecs.BOM_UTF16_LE, "utf-16-le"),
    (codecs.BOM_UTF16_BE, "utf-16-be"),
)
# Other formats saved under a text name: say what they really are.
_MAGIC = (
    (b"%PDF", "a PDF"),
    (b"PK\x03\x04", "a zip archive (perhaps a Word, Excel or PowerPoint file)"),
    (b"\xd0\xcf\x11\xe0", "an old-style Office document (.doc, .xls or .ppt)"),
    (b"\x89PNG", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"GIF8", "a GIF image"),
)
# Characters that don't belong in text: C0/C1 controls (not tab/newline/CR/FF),
# the replacement character, private-use and lone surrogates.
_JUNK = re.compile(r"[\x00-\x08\x0e-\x1f\x7f-\x9f\ufffd\ue000-\uf8ff\ud800-\udfff]")
_JUNK_SAMPLE = 1_000_000  # characters checked
_MAX_JUNK = 0.10  # more than this share of junk: not a text file
# charset-normalizer often names a Baltic or Central European code page for short Western
# text; when Windows-1252 reads the bytes about as cleanly we take it instead.
_WESTERN = ("cp1252", "latin_1", "iso8859_15")


def decode_text(data: bytes) -> str:
    """Bytes of a text file in any common encoding -> str. Raises ExtractionError when the
    bytes are not text at all."""
    check_not_other_format(data)
    text = _decode(data)
    check_mostly_text(text)
    return text


def check_not_other_format(data: bytes) -> None:
    """Refuse a PDF, Office file or image that was saved under a text name."""
    for magic, what in _MAGIC:
        if data.startswith(magic):
            raise ExtractionError(
                f"This file is really {what}, not plain text. Rename it with the right "
                "ending, or upload the original document."
            )


def check_mostly_text(text: str) -> None:
    """Refuse decoded "text" that is mostly control characters and other junk."""
    sample = text[:_JUNK_SAMPLE]
    if sample and len(_JUNK.findall(sample)) > _MAX_JUNK * len(sample):
        raise ExtractionError(NOT_TEXT)


def _decode(data: bytes) -> str:
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            return data[len(bom) :].decode(encoding, errors="replace")
    utf16 = _utf16_without_bom(data)  # before UTF-8: NULs are valid UTF-8
    if utf16 is not None:
        return utf16
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    import charset_normalizer

    matches = [
        m
        for m in charset_normalizer.from_bytes(data)
        if not m.encoding.startswith(("utf_16", "utf_32"))  # only ever with NULs, above
    ]
    if not matches:
        # No encoding reads it cleanly: perhaps UTF-8 with a few damaged bytes. Decode what
        # we can; check_mostly_text then decides whether enough of it is text.
        return data.decode("utf-8", errors="replace")
    best = matches[0]
    for match in matches:
        if match.encoding in _WESTERN and match.chaos <= best.chaos + 0.1:
            best = match
            break
    log.debug("decoded as %s (chaos %.3f)", best.encoding, best.chaos)
    return str(best)


def _utf16_without_bom(data: bytes) -> str | None:
    """Mostly-ASCII UTF-16 has a NUL in every other byte; recognise that pattern."""
    sample = data[:4096]
    if len(sample) < 4:
        return None
    odd_nuls = sample[1::2].count(0) / len(sample[1::2])
    even_nuls = sample[0::2].count(0) / len(sample[0::2])
    candidates = ((odd_nuls, even_nuls, "utf-16-le"), (even_nuls, odd_nuls, "utf-16-be"))
    for share, other, encoding in candidates:
        if share > 0.4 and other < 0.05:
            try:
                return data[: len(data) // 2 * 2].decode(encoding)
            except UnicodeDecodeError:
                return None
    return None


def extract_txt(path: Path, ctx: ReadContext) -> Extracted:
    budget = ctx.budget
    text = decode_text(read_limited(path))
    return Extracted(text=budget.add(text))


# --- HTML ---------------------------------------------------------------------------------

_DROP = frozenset(
    [
        "head",
        "title",
        "meta",
        "link",
        "script",
        "style",
        "noscript",
        "template",
        "nav",
        "svg",
        "canvas",
        "iframe",
        "object",
        "embed",
        "button",
        "select",
        "datalist",
        "textarea",
        "audio",
        "video",
        "map",
    ]
)
_BLOCKS = frozenset(
    [
        "address",
        "article",
        "aside",
        "blockquote",
        "body",
        "caption",
        "center",
        "dd",
        "details",
        "dialog",
        "div",
        "dl",
        "dt",
        "fieldset",
        "figcaption",
        "figure",
        "footer",
        "form",
        "h1",
        "h2",
        "h3",
        "h4",
        "h5",
        "h6",
        "header",
        "hgroup",
        "html",
        "legend",
        "li",
        "main",
        "menu",
        "ol",
        "p",
        "pre",
        "section",
        "summary",
        "table",
        "ul",
    ]
)
_CELLS = frozenset(("td", "th"))
_PARA, _LINE, _CELL = "\n\n", "\n", "\x1f"
_SPACES = re.compile(r"\s+")
_HIDDEN_STYLE = re.compile(r"display\s*:\s*none|visibility\s*:\s*hidden", re.IGNORECASE)


class _Exit:
    """Marks the end of a tag on the walk's stack."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


def extract_html(path: Path, ctx: ReadContext) -> Extracted:
    """Visible text of a web page: scripts, styles, navigation and <head> dropped."""
    budget = ctx.budget
    from bs4 import BeautifulSoup

    data = read_limited(path)
    check_not_other_format(data)
    check_markup(data)
    # Bytes, not str: BeautifulSoup honours the page's own <meta charset> first.
    text = html_to_text(BeautifulSoup(data, "lxml"))
    check_mostly_text(text)
    return Extracted(text=budget.add(text))


def extract_md(path: Path, ctx: ReadContext) -> Extracted:
    budget = ctx.budget
    from bs4 import BeautifulSoup
    from markdown_it import MarkdownIt

    source = decode_text(read_limited(path))
    renderer = MarkdownIt("commonmark", {"html": True}).enable(["table", "strikethrough"])
    soup = BeautifulSoup(renderer.render(source), "lxml")
    return Extracted(text=budget.add(html_to_text(soup)))


def html_to_text(soup) -> str:
    """Walk the parsed page (iteratively: pages can nest deeply) and write its text, with
    block elements as paragraphs, <br> and table rows as lines and cells joined by " | "."""
    from bs4.element import CData, NavigableString, Tag

    out: list[str] = []
    stack: list[object] = [soup]
    in_pre = in_cell = 0
    while stack:
        node = stack.pop()
        if isinstance(node, _Exit):
            name = node.name
            if name == "pre":
                in_pre -= 1
            if name in _CELLS:
                in_cell -= 1
                out.append(_CELL)
            elif name == "tr":
                out.append(_LINE)
            elif name in _BLOCKS:
                out.append(" " if in_cell else _PARA)
            continue
        if isinstance(node, NavigableString):
            # Comments, doctypes and processing instructions are NavigableString subclasses.
            if type(node) is NavigableString or isinstance(node, CData):
                out.append(str(node) if in_pre else _SPACES.sub(" ", str(node)))
            continue
        if not isinstance(node, Tag):
            continue
        name = (node.name or "").lower()
        if name in _DROP or _hidden(node):
            continue
        if name == "br":
            out.append(_LINE)
            continue
        if name == "hr":
            out.append(_PARA)
            continue
        if name == "pre":
            in_pre += 1
        if name in _CELLS:
            in_cell += 1
        elif name in _BLOCKS:
            out.append(" " if in_cell else _PARA)
        stack.append(_Exit(name))
        stack.extend(reversed(node.contents))
    lines = []
    for line in "".join(out).split("\n"):
        if _CELL in line:
            line = " | ".join(c.strip() for c in line.split(_CELL) if c.strip())
        lines.append(line)
    return "\n".join(lines)


def _hidden(tag) -> bool:
    attrs = tag.attrs or {}
    if "hidden" in attrs or str(attrs.get("aria-hidden", "")).lower() == "true":
        return True
    style = attrs.get("style")
    return bool(style) and _HIDDEN_STYLE.search(str(style)) is not None
