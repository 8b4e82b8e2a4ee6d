"""Word, PowerPoint and Excel files (python-docx, python-pptx, openpyxl).

All three are zip archives of XML. Before any library opens one we read the zip's central
directory and refuse archives that would unpack to something enormous (a "zip bomb"), then
inflate every member once ourselves, in bounded pieces, and refuse one that unpacks to more
than the directory declares: Python's zipfile cuts a member at its declared size, but only
after inflating all of it in one call, so a directory that understates a member is a zip bomb
the declared sizes do not show. A workbook's sheets are scanned for row and column numbers
beyond Excel's own limits before openpyxl walks them (it pads every missing row).
The XML parsers these libraries use don't fetch external entities, and libxml2/expat refuse
runaway entity expansion.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
import struct
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path

from worker.extract.common import (
    MAX_SHEET_CELLS,
    MAX_UNZIPPED_BYTES,
    MAX_XML_TAGS,
    MAX_ZIP_MEMBERS,
    Extracted,
    ExtractionError,
    ReadContext,
    TextBudget,
    damaged,
    normalize_inline,
    too_much_markup,
)

log = logging.getLogger(__name__)

_OLE_MAGIC = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"  # old .doc/.xls/.ppt, and encrypted Office
_OLD_FORMAT = {
    "docx": ("Word document", ".doc", ".docx"),
    "pptx": ("presentation", ".ppt", ".pptx"),
    "xlsx": ("workbook", ".xls", ".xlsx"),
}


def check_zip(path: Path, kind: str) -> None:
    """Refuse anything that is not a sane zip before a library unpacks it."""
    with open(path, "rb") as f:
        head = f.read(8)
    if head.startswith(_OLE_MAGIC):
        noun, old, new = _OLD_FORMAT[kind]
        raise ExtractionError(
            f"This {noun} is password-protected or saved in the old {old} format. Remove the "
            f"password (or use Save As and pick {new}) and upload it again."
        )
    if not head.startswith(b"PK"):
        raise damaged(kind)
    try:
        with zipfile.ZipFile(path) as zf:
            members = zf.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError) as exc:
        log.warning("bad zip %s: %s", path, exc)
        raise damaged(kind) from exc
    unpacked = sum(m.file_size for m in members)
    if len(members) > MAX_ZIP_MEMBERS or unpacked > MAX_UNZIPPED_BYTES:
        log.warning("refusing %s: %d members, %d bytes unpacked", path, len(members), unpacked)
        raise ExtractionError(
            f"This file would unpack to {unpacked / 2**20:,.0f} MB in {len(members):,} parts, "
            "far more than a normal document; DocTune refuses it to protect the computer. "
            "If it is genuine, split it into smaller files."
        )
    if any(m.flag_bits & 0x1 for m in members):
        raise ExtractionError(ZIP_PASSWORD)
    try:
        with open(path, "rb") as fh:
            for member in members:
                size, tags = _real_size(fh, member)
                if size != member.file_size:
                    log.warning("refusing %s: %s is not the size its directory says", path,
                                member.filename)
                    raise ExtractionError(LYING_ZIP)
                if tags > MAX_XML_TAGS and member.filename.lower().endswith(_XML_PARTS):
                    log.warning("refusing %s: %s holds %d tags", path, member.filename, tags)
                    raise ExtractionError(too_much_markup(MAX_XML_TAGS))
    except (OSError, zlib.error, struct.error, ValueError) as exc:
        log.warning("bad zip member in %s: %s", path, exc)
        raise damaged(kind) from exc


LYING_ZIP = (
    "This file's table of contents gives false sizes for its parts (one unpacks to more than "
    "it declares), as files built to crash programs do; DocTune refuses it to protect the "
    "computer. If it is genuine, open it and save it again, then upload the copy."
)
ZIP_PASSWORD = (
    "This file is password-protected (its parts are encrypted), so its text cannot be read. "
    "Remove the password, save it again and upload the copy."
)
_PIECE = 1 << 20  # bytes inflated per step
_XML_PARTS = (".xml", ".rels", ".xhtml", ".html", ".htm")  # parts whose tags are counted


def _real_size(fh, member: zipfile.ZipInfo) -> tuple[int, int]:
    """How many bytes `member` really inflates to, up to one more than it declares, and how
    many "<" (XML tags, counted as it inflates, so a part of three million empty paragraphs is
    refused before a parser builds a tree of them): its compressed bytes (as the directory
    locates them, which is what zipfile reads) inflated in pieces of at most _PIECE bytes, so a
    lying member costs no more memory than an honest one."""
    fh.seek(member.header_offset)
    header = fh.read(30)
    if len(header) < 30 or header[:4] != b"PK\x03\x04":
        raise ValueError("no local header")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    fh.seek(member.header_offset + 30 + name_len + extra_len)
    left, limit = member.compress_size, member.file_size + 1
    if member.compress_type == zipfile.ZIP_STORED:
        size, tags = 0, 0
        while left > 0 and size < limit:
            data = fh.read(min(left, limit - size, _PIECE))
            if not data:
                break
            left, size, tags = left - len(data), size + len(data), tags + data.count(b"<")
        return size, tags
    if member.compress_type != zipfile.ZIP_DEFLATED:  # Office and EPUB writers use deflate
        raise ValueError(f"compression method {member.compress_type}")
    inflate, size, tags = zlib.decompressobj(-15), 0, 0
    while left > 0 and size < limit and not inflate.eof:
        data = fh.read(min(left, 1 << 16))
        if not data:
            break
        left -= len(data)
        while data and size < limit:
            piece = inflate.decompress(data, _PIECE)
            size, tags = size + len(piece), tags + piece.count(b"<")
            data = inflate.unconsumed_tail
    return size, tags


# --- Word ---------------------------------------------------------------------------------

_W = "http://schemas.openxmlformats.org/wordprocessingml/2006/main"
_MC = "http://schemas.openxmlformats.org/markup-compatibility/2006"


def _w(tag: str) -> str:
    return f"{{{_W}}}{tag}"


_P, _TBL, _TR, _TC, _R = _w("p"), _w("tbl"), _w("tr"), _w("tc"), _w("r")
_SDT, _SDT_CONTENT, _CUSTOM_XML, _TXBX = (
    _w("sdt"),
    _w("sdtContent"),
    _w("customXml"),
    _w("txbxContent"),
)
# Inside a paragraph: deleted (tracked-change) text, formatting and the duplicate "fallback"
# copy of drawings are skipped.
_SKIP_IN_PARAGRAPH = {
    _w("del"),
    _w("moveFrom"),
    _w("pPr"),
    _w("rPr"),
    _w("instrText"),
    f"{{{_MC}}}Fallback",
}
_RUN_TEXT = {
    _w("t"): None,
    _w("tab"): "\t",
    _w("br"): "\n",
    _w("cr"): "\n",
    _w("noBreakHyphen"): "-",
    _w("ptab"): "\t",
}


def extract_docx(path: Path, ctx: ReadContext) -> Extracted:
    """Body paragraphs and tables in document order (content controls and text boxes too);
    a table row becomes one line with its cells joined by " | "."""
    budget = ctx.budget
    check_zip(path, "docx")
    import docx

    document = docx.Document(str(path))
    blocks: list[str] = []
    _docx_blocks(document.element.body, blocks, budget)
    return Extracted(text="\n\n".join(blocks))


def _docx_blocks(container, out: list[str], budget: TextBudget) -> None:
    for child in container:
        tag = child.tag
        if tag == _P:
            text, boxes = _docx_paragraph(child)
            if text.strip():
                out.append(budget.add(text))
            for box in boxes:
                _docx_blocks(box, out, budget)
        elif tag == _TBL:
            _docx_table(child, out, budget)
        elif tag in (_SDT, _SDT_CONTENT, _CUSTOM_XML):
            _docx_blocks(child, out, budget)


def _docx_paragraph(p) -> tuple[str, list]:
    """A paragraph's visible text, and any text boxes anchored in it."""
    parts: list[str] = []
    boxes = []
    stack = list(reversed(p))
    while stack:
        el = stack.pop()
        tag = el.tag
        if not isinstance(tag, str) or tag in _SKIP_IN_PARAGRAPH:
            continue  # comments/processing instructions, or skipped content
        if tag == _TXBX:
            boxes.append(el)
            continue
        if tag == _R:
            for item in el:
                if item.tag in _RUN_TEXT:
                    fixed = _RUN_TEXT[item.tag]
                    parts.append((item.text or "") if fixed is None else fixed)
        stack.extend(reversed(el))  # runs hold drawings, which may hold text boxes
    return "".join(parts), boxes


def _rows(tbl) -> Iterator:
    for el in tbl:
        if el.tag == _TR:
            yield el
        elif el.tag in (_SDT, _SDT_CONTENT, _CUSTOM_XML):
            yield from _rows(el)


def _cells(tr) -> Iterator:
    for el in tr:
        if el.tag == _TC:
            yield el
        elif el.tag in (_SDT, _SDT_CONTENT, _CUSTOM_XML):
            yield from _cells(el)


def _docx_table(tbl, out: list[str], budget: TextBudget) -> None:
    lines = []
    for tr in _rows(tbl):
        cells = []
        for tc in _cells(tr):
            inner: list[str] = []
            _docx_blocks(tc, inner, budget)
            cell = normalize_inline(" ".join(inner))
            if cell:
                cells.append(cell)
        if cells:
            lines.append(" | ".join(cells))
    if lines:
        out.append("\n".join(lines))


# --- PowerPoint ---------------------------------------------------------------------------


def extract_pptx(path: Path, ctx: ReadContext) -> Extracted:
    """Each slide's text boxes, tables and speaker notes; one paragraph per shape."""
    budget = ctx.budget
    check_zip(path, "pptx")
    from pptx import Presentation

    presentation = Presentation(str(path))
    blocks: list[str] = []
    for slide in presentation.slides:
        for shape in _shapes(slide.shapes):
            if getattr(shape, "has_text_frame", False) and shape.has_text_frame:
                lines = [p.text for p in shape.text_frame.paragraphs]
                text = "\n".join(line for line in lines if line.strip())
                if text:
                    blocks.append(budget.add(text))
            if getattr(shape, "has_table", False) and shape.has_table:
                rows = []
                for row in shape.table.rows:
                    cells = [
                        normalize_inline(cell.text) for cell in row.cells if not cell.is_spanned
                    ]
                    if any(cells):
                        rows.append(" | ".join(c for c in cells if c))
                if rows:
                    blocks.append(budget.add("\n".join(rows)))
        if slide.has_notes_slide:
            notes = slide.notes_slide.notes_text_frame
            if notes is not None and notes.text.strip():
                blocks.append(budget.add(notes.text))
    return Extracted(text="\n\n".join(blocks))


def _shapes(shapes) -> Iterator:
    """Every shape, looking inside groups."""
    from pptx.shapes.group import GroupShape

    for shape in shapes:
        if isinstance(shape, GroupShape):
            yield from _shapes(shape.shapes)
        else:
            yield shape


# --- Excel --------------------------------------------------------------------------------


def extract_xlsx(path: Path, ctx: ReadContext) -> Extracted:
    """Every worksheet. When a sheet's first row looks like column headings, each following
    row becomes a paragraph of "Heading: value" lines; otherwise each row is one line with its
    cells joined by " | ". Empty rows and cells are skipped; formulas give their saved value.
    A sheet with a real title ("Prices", not "Sheet1") starts with that title."""
    budget = ctx.budget
    check_zip(path, "xlsx")
    check_sheet_numbers(path)
    import openpyxl

    workbook = openpyxl.load_workbook(path, read_only=True, data_only=True)
    try:
        blocks: list[str] = []
        cells = _CellCounter()
        for sheet in workbook.worksheets:
            sheet_blocks = _sheet_blocks(sheet, budget, cells)
            if sheet_blocks and not _default_sheet_name(sheet.title):
                blocks.append(sheet.title)
            blocks.extend(sheet_blocks)
    finally:
        workbook.close()
    return Extracted(text="\n\n".join(blocks))


EXCEL_ROWS, EXCEL_COLUMNS = 1_048_576, 16_384  # Excel's own limits (XFD1048576)
_ROW_NUMBER = re.compile(rb"<(?:[A-Za-z_][\w.-]*:)?row\s[^>]*?(?<=\s)r\s*=\s*[\"'](\d+)")
_CELL_REF = re.compile(
    rb"<(?:[A-Za-z_][\w.-]*:)?c\s[^>]*?(?<=\s)r\s*=\s*[\"']\$?([A-Za-z]+)\$?(\d+)"
)
BEYOND_EXCEL = (
    "This workbook names a row or column beyond Excel's own limits (1,048,576 rows, 16,384 "
    "columns), which no real spreadsheet does; DocTune refuses it to protect the computer. "
    "Open it in Excel or LibreOffice, save it again and upload the copy."
)


def check_sheet_numbers(path: Path) -> None:
    """Scan every worksheet's XML (streamed, in bounded pieces; check_zip has vouched for the
    sizes) for row and cell numbers past Excel's limits: openpyxl walks every missing row up to
    the highest one, so a 1.6 KB sheet naming row 10^12 would never finish."""
    with zipfile.ZipFile(path) as zf:
        for member in zf.infolist():
            name = member.filename
            if not (name.startswith("xl/worksheets/") and name.endswith(".xml")):
                continue
            tail = b""
            with zf.open(member) as fh:
                while piece := fh.read(_PIECE):
                    data = tail + piece
                    _check_numbers(data)
                    tail = data[-256:]


def _check_numbers(data: bytes) -> None:
    for match in _ROW_NUMBER.finditer(data):
        if len(match.group(1)) > 7 or int(match.group(1)) > EXCEL_ROWS:
            raise ExtractionError(BEYOND_EXCEL)
    for match in _CELL_REF.finditer(data):
        letters, digits = match.group(1), match.group(2)
        if len(digits) > 7 or int(digits) > EXCEL_ROWS or len(letters) > 3:
            raise ExtractionError(BEYOND_EXCEL)
        column = 0
        for ch in letters.upper():
            column = column * 26 + ch - 64
        if column > EXCEL_COLUMNS:
            raise ExtractionError(BEYOND_EXCEL)


class _CellCounter:
    """Cells visited across the workbook, empty ones included (they cost time too)."""

    def __init__(self) -> None:
        self.seen = 0

    def add(self, n: int) -> None:
        self.seen += n
        if self.seen > MAX_SHEET_CELLS:
            raise ExtractionError(
                "This workbook has too many cells for DocTune to read; split it into smaller files."
            )


def _sheet_blocks(sheet, budget: TextBudget, cells: _CellCounter) -> list[str]:
    # Ignore the sheet's declared size: a forged one (A1:XFD1048576) would make openpyxl
    # pad every row with thousands of empty cells, and add a million empty rows.
    sheet.reset_dimensions()
    header: dict[int, str] | None = None
    records: list[str] = []
    lines: list[str] = []
    first = True
    for row in sheet.iter_rows(values_only=True):
        cells.add(max(len(row), 1))  # an empty row costs a step too
        filled = [(i, v) for i, v in enumerate(row) if v is not None]
        values = [(i, text) for i, v in filled if (text := _cell_text(v))]
        if not values:
            continue
        if first:
            first = False
            if len(values) >= 2 and all(isinstance(v, str) for _, v in filled):
                header = dict(values)
                continue
        if header is not None:
            record = [f"{header[i]}: {text}" if i in header else text for i, text in values]
            records.append(budget.add("\n".join(record)))
        else:
            lines.append(budget.add(" | ".join(text for _, text in values)))
    if header is not None and not records:
        lines.insert(0, " | ".join(header.values()))  # only a row of labels: keep it
    if lines:
        records.append("\n".join(lines))
    return records


_DEFAULT_SHEET_NAME = re.compile(
    r"(sheet|feuil|tabelle|hoja|foglio|blad|planilha)\s*\d*", re.IGNORECASE
)


def _default_sheet_name(title: str) -> bool:
    """True for "Sheet1" and its translations, which say nothing; "Prices" is kept."""
    return _DEFAULT_SHEET_NAME.fullmatch(title.strip()) is not None


def _cell_text(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return format(value, ".12g")
    if isinstance(value, dt.datetime):
        if value.time() == dt.time(0):
            return value.date().isoformat()
        return value.isoformat(sep=" ", timespec="minutes")
    if isinstance(value, dt.date | dt.time):
        return value.isoformat()
    return normalize_inline(str(value))
