"""The recall experiment's practice of table cells (scripts/experiments/cells.py): each
cell practised by row and column in a few wordings, never in the card's."""

from __future__ import annotations

import pytest

from scripts.experiments.cells import cell_practice, practising_cells
from worker.dataset.build import make_generated_qa
from worker.dataset.colleague import TABLE, make_probes
from worker.dataset.probes import normalise
from worker.dataset.tables import find_tables

PRODUCTS = """Product list

Code | Product | Price (GBP) | In stock | Bin | Used for
SG-3340 | Glacia blast chiller | 4726 | 4 | C-12 | chilling cooked food
SG-7140 | Limescale descaler 5L | 27.6 | 187 | K-13 | descaling combi ovens
SG-7251 | Vantora core probe | 142.3 | 29 | K-24 | -
"""

TESTS = """QC procedure

Test | Applies to | Pass limit
Earth continuity | All electric units | 0.1 ohm or less
Gas tightness | All gas units | no more than 0.5 mbar drop
"""


def _table(name: str, text: str):
    (table,) = find_tables(name, text)
    return table


def test_every_cell_in_up_to_n_wordings_each_answered_with_the_whole_relation():
    table = _table("product_list.xlsx", PRODUCTS)
    three = cell_practice(table, 3)
    # 3 rows: price, stock, bin, use (not the core probe's "-"), the code both ways.
    cells = 3 * 3 + 2
    assert len(three) == 3 * (cells + 2 * 3)
    assert len(cell_practice(table, 1)) == cells + 2 * 3
    assert cell_practice(table, 0) == []
    by_answer: dict[str, list[str]] = {}
    for q, a in three:
        by_answer.setdefault(a, []).append(q)
    assert by_answer["The bin of the Limescale descaler 5L is K-13."] == [
        "What bin does the Limescale descaler 5L have?",
        "Which bin is listed for the Limescale descaler 5L?",
        "In the product list, what is the Limescale descaler 5L's bin?",
    ]
    # A header's unit is left out of the question; a count in stock asked as a count.
    assert "The price of the Glacia blast chiller is 4726." in by_answer
    assert "How many Vantora core probe do we have in stock?" in by_answer[
        "The Vantora core probe: 29 in stock."]
    # "Used for" is no noun to put after "what": the column is named instead.
    assert by_answer["The Glacia blast chiller is used for chilling cooked food."][0] == (
        "In the product list, what is listed under Used for for the Glacia blast chiller?")
    # The code by the name and the name by the code.
    assert "What code does the Glacia blast chiller have?" in by_answer[
        "The code of the Glacia blast chiller is SG-3340."]
    assert by_answer["SG-3340 is the Glacia blast chiller."] == [
        "Look up SG-3340 in the product list: which product is it?",
        "SG-3340 is the code of which product?",
        "Name the product with code SG-3340.",
    ]
    # No cell's value in its own question.
    assert all(normalise(a.split(" is ")[-1].rstrip(".")) not in normalise(q)
               for q, a in three if " is " in a)


def test_a_verb_header_is_answered_as_a_sentence():
    table = _table("qc_procedure.docx", TESTS)
    answers = {a for _, a in cell_practice(table, 1)}
    assert answers == {
        "The Earth continuity applies to All electric units.",
        "The pass limit of the Earth continuity is 0.1 ohm or less.",
        "The Gas tightness applies to All gas units.",
        "The pass limit of the Gas tightness is no more than 0.5 mbar drop.",
    }


@pytest.mark.parametrize("wordings", [0, 3])
def test_practised_only_when_asked_for_and_never_in_the_card_s_words(wordings):
    docs = [("product_list.xlsx", PRODUCTS), ("qc_procedure.docx", TESTS)]
    probes = make_probes(docs, max_probes=40)
    table_cards = [p for p in probes if p.kind == TABLE]
    assert len(table_cards) >= 5
    before = make_generated_qa(docs, probes, per_fact=2)
    with practising_cells(wordings):
        practice = make_generated_qa(docs, probes, per_fact=2)
    assert make_generated_qa(docs, probes, per_fact=2) == before  # put back
    added = practice[len(before):]
    assert practice[: len(before)] == before
    if not wordings:
        assert added == []
        return
    assert len(added) == sum(len(cell_practice(t, wordings)) for n, x in docs
                             for t in find_tables(n, x))
    card = {normalise(p.question) for p in probes}
    assert not card & {normalise(q) for q, _ in practice}  # DESIGN.md's honesty rule
    # Every cell the card asks is practised, in other words, with its answer.
    for p in table_cards:
        assert any(normalise(p.answer) in normalise(a) for _, a in added), p.question
