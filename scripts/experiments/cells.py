"""The recall experiment's practice of a table's cells (`table_cells=N`; measured, not kept:
README "Every table cell, practised"): each value asked for by its row and column in a few
wordings, worded apart from the card's (worker.dataset.colleague.table_questions), and each
answered with the whole relation ("The bin of the Limescale descaler 5L is K-13.").

A colleague looks a value up by row and column ("Which bin is the descaler kept in?", "What
is SG-3340?"). A model that only read the table as text, or recited it row by row, answered
almost none of those (README "A second company, held out"): the row practice of
colleague.table_practice teaches a row's whole line, not one cell of it. Who holds which job
(worker.dataset.roles) was learnt from three wordings a fact, not from one; so are cells
here, up to `wordings` each. Pure Python, templates only.
"""

from __future__ import annotations

import contextlib

from worker.dataset.colleague import _header_words, header_shape
from worker.dataset.probes import normalise
from worker.dataset.questions import title_of
from worker.dataset.tables import Row, Table, find_tables


@contextlib.contextmanager
def practising_cells(wordings: int):
    """The dataset builder practising every table cell of the trained text in `wordings`
    wordings, beside who holds which job (and through the same filter: never a card's
    question)."""
    from worker.dataset import build

    saved = build.role_practice_of

    def with_cells(docs):
        return saved(docs) + [pair for name, text in docs for table in find_tables(name, text)
                              for pair in cell_practice(table, wordings)]

    if wordings:
        build.role_practice_of = with_cells
    try:
        yield
    finally:
        build.role_practice_of = saved


def cell_practice(table: Table, wordings: int) -> list[tuple[str, str]]:
    """(question, answer) for every cell of `table`, at most `wordings` wordings each, and a
    coded row both ways (its code by its name, its name by its code)."""
    if wordings <= 0:
        return []
    title = title_of(table.source)
    out: list[tuple[str, str]] = []
    for row in table.rows:
        for header, value in row.cells.items():
            if _is_value(value):
                out += _cell(title, header, row.key, value)[:wordings]
        if row.code and table.code_header:
            out += _by_name(title, table, row)[:wordings] + _by_code(title, table, row)[:wordings]
    return out


def _is_value(value: str) -> bool:
    """A "-" or a single letter is no fact to ask; a single digit is ("4" in stock)."""
    n = normalise(value)
    return len(n) >= 2 or n.isdigit()


def _cell(title: str, header: str, key: str, value: str) -> list[tuple[str, str]]:
    """One cell in up to three wordings, by how its column's header reads
    (worker.dataset.colleague.header_shape)."""
    shape = header_shape(header)
    if shape is None:
        return []
    kind, h = shape
    if kind == "preposition":  # "In stock": "The Vantora core probe: 29 in stock."
        answer = f"The {key}: {value} {h}."
        if any(c.isdigit() for c in value):
            return [(q, answer) for q in (
                f"How many {key} do we have {h}?",
                f"What number of the {key} is {h}?",
                f"In {title}, how many of the {key} are listed as {h}?",
            )]
        return [(q, answer) for q in _listed(title, header, key)]
    if kind == "verb":  # "Applies to"
        return [(q, f"The {key} {h} {value}.") for q in _listed(title, header, key)]
    if kind == "participle":  # "Used for"
        return [(q, f"The {key} is {h} {value}.") for q in _listed(title, header, key)]
    return _noun(title, h, key, value)


def _noun(title: str, h: str, key: str, value: str) -> list[tuple[str, str]]:
    """A column named by a noun ("Bin", "Price (GBP)"); the card asks "What is the bin of
    the ...?", so these do not."""
    answer = f"The {h} of the {key} is {value}."
    return [(q, answer) for q in (
        f"What {h} does the {key} have?",
        f"Which {h} is listed for the {key}?",
        f"In {title}, what is the {key}'s {h}?",
    )]


def _listed(title: str, header: str, key: str) -> tuple[str, ...]:
    """Wordings for a column whose header is not a noun ("Applies to", "Used for")."""
    return (
        f"In {title}, what is listed under {header} for the {key}?",
        f"For the {key}, what does the {header} column say?",
        f"Look up the {key} in {title}: {header}?",
    )


def _by_name(title: str, table: Table, row: Row) -> list[tuple[str, str]]:
    return _noun(title, _header_words(table.code_header), row.key, row.code)


def _by_code(title: str, table: Table, row: Row) -> list[tuple[str, str]]:
    """The row a code names; the card asks "Which product has the code SG-3340?"."""
    noun = _header_words(table.key_header) or "entry"
    code_noun = _header_words(table.code_header)
    answer = f"{row.code} is the {row.key}."
    return [(q, answer) for q in (
        f"Look up {row.code} in {title}: which {noun} is it?",
        f"{row.code} is the {code_noun} of which {noun}?",
        f"Name the {noun} with {code_noun} {row.code}.",
    )]
