"""Tables in extracted text, as rows keyed by name: what a colleague looks up by row and column.

The readers (worker/extract) write a table in one of two shapes:

- a pipe table (DOCX, PPTX, Markdown, HTML): a header line, then one line per row,
  cells joined by " | ";
- records (XLSX, CSV without Q&A columns): a paragraph per row, one "Header: value" line
  per cell.

A table becomes a `Table` when its rows can be told apart by a key: the first column whose
values are words (not numbers) and all different ("Torque Sprocket", "DeskDock"); a column of
codes that are all different ("NW-4471") is a second key. Pure Python, no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_MIN_ROWS = 2  # one row is a list of fields, not a table to look things up in
_MAX_CELL_CHARS = 80  # a long cell is prose, not a value to ask for


@dataclass(frozen=True)
class Row:
    key: str  # the row's name ("Torque Sprocket")
    cells: dict[str, str]  # header -> value, the key column and empty cells left out
    code: str = ""  # the row's code when the table has a column of codes ("NW-4471")


@dataclass(frozen=True)
class Table:
    source: str  # document name
    key_header: str  # the key column's header ("Product")
    rows: list[Row] = field(default_factory=list)
    code_header: str = ""  # the codes' column ("Code"), "" when there is none

    def column(self, header: str) -> list[str]:
        return [r.cells[header] for r in self.rows if header in r.cells]


def _is_code(value: str) -> bool:
    """Letters and digits mixed, no spaces: "NW-4471", "A12B"."""
    return (
        " " not in value
        and bool(re.search(r"\d", value))
        and bool(re.search(r"[A-Za-z]", value))
        and len(value) <= 24
    )


def _is_name(value: str) -> bool:
    """Words, not a number or a code: "Torque Sprocket", "Gale Fan Mk II"."""
    letters = sum(c.isalpha() for c in value)
    return letters >= 3 and letters >= 0.6 * len(value.replace(" ", "")) and not _is_code(value)


def _clean_header(header: str) -> str:
    return re.sub(r"\s+", " ", header).strip(" :*_#")


def _pipe_tables(text: str) -> list[list[list[str]]]:
    """Runs of " | " lines with the same number of cells (at least 2): header first."""
    tables: list[list[list[str]]] = []
    run: list[list[str]] = []
    for line in text.splitlines() + [""]:
        cells = [c.strip() for c in line.split(" | ")] if " | " in line else []
        if len(cells) >= 2 and (not run or len(cells) == len(run[0])):
            run.append(cells)
            continue
        if len(run) > _MIN_ROWS:
            tables.append(run)
        run = [cells] if len(cells) >= 2 else []
    return tables


_RECORD_LINE = re.compile(r"^([^:\n]{1,40}):\s+(\S.*)$")


def record_cells(para: str) -> list[tuple[str, str]] | None:
    """(header, value) of each line of a paragraph made only of "Header: value" lines (two
    or more: one table row as the readers write records); None for any other paragraph."""
    lines = [ln.strip() for ln in para.strip().splitlines() if ln.strip()]
    matches = [_RECORD_LINE.match(ln) for ln in lines]
    if len(lines) < 2 or not all(matches):
        return None
    return [(m.group(1).strip(), m.group(2).strip()) for m in matches if m]


def _record_tables(text: str) -> list[list[list[str]]]:
    """Consecutive paragraphs that are all "Header: value" lines with the same headers."""
    tables: list[list[list[str]]] = []
    headers: list[str] | None = None
    rows: list[list[str]] = []

    def flush() -> None:
        if headers and len(rows) >= _MIN_ROWS:
            tables.append([headers, *rows])

    for para in re.split(r"\n\s*\n", text):
        cells = record_cells(para)
        if cells is None:
            flush()
            headers, rows = None, []
            continue
        these = [h for h, _ in cells]
        values = [v for _, v in cells]
        if these != headers:
            flush()
            headers, rows = these, []
        rows.append(values)
    flush()
    return tables


def _keyed(source: str, grid: list[list[str]]) -> Table | None:
    """A table from a header line and rows, when some column tells the rows apart."""
    header = [_clean_header(h) for h in grid[0]]
    body = [r for r in grid[1:] if len(r) == len(header)]
    if len(body) < _MIN_ROWS or len(set(header)) != len(header) or not all(header):
        return None

    def distinct(col: int, test) -> bool:
        values = [r[col] for r in body]
        return all(v and test(v) for v in values) and len({v.casefold() for v in values}) == len(
            values
        )

    key = next((c for c in range(len(header)) if distinct(c, _is_name)), None)
    if key is None:
        return None
    code = next((c for c in range(len(header)) if c != key and distinct(c, _is_code)), None)
    rows = []
    for r in body:
        cells = {
            header[c]: v
            for c, v in enumerate(r)
            if c not in (key, code) and v and len(v) <= _MAX_CELL_CHARS
        }
        rows.append(Row(key=r[key], cells=cells, code=r[code] if code is not None else ""))
    return Table(
        source=source,
        key_header=header[key],
        rows=rows,
        code_header=header[code] if code is not None else "",
    )


def find_tables(source: str, text: str) -> list[Table]:
    """The keyed tables of one document's extracted text, in the order they appear."""
    found = [_keyed(source, g) for g in _pipe_tables(text) + _record_tables(text)]
    return [t for t in found if t is not None]
