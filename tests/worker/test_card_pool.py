"""The card-pool experiment (scripts/experiments/card_pool.py): the pool holds every question
the card could ask, and its figures are the card's own arithmetic."""

from __future__ import annotations

import pytest

from scripts.experiments.card_pool import estimates, pool_of, sentences_of
from scripts.experiments.recall import load_corpus
from worker.dataset.colleague import make_probes


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    return [(d.name, d.text) for d in load_corpus(folder, "fixture")]


def test_the_pool_holds_every_card_question_and_the_sentences_are_split(docs):
    pool = pool_of(docs)
    asked = {(q["question"], q["answer"]) for q in pool}
    card = make_probes(docs, 40, seed=0)
    assert card and all((p.question, p.answer) in asked for p in card)
    assert {q["kind"] for q in pool} == {"other words", "reverse", "table"}
    assert len(pool) > len(card)
    sentences = sentences_of(docs)
    phrased = [s for s in sentences if s["phrased"]]
    assert 0 < len(phrased) < len(sentences)
    # Each forward question of the pool comes from a sentence marked phrased.
    forward = [q for q in pool if q["kind"] == "other words"]
    assert len(forward) <= len(phrased)
    assert all(s["prompt"] and s["answer"] not in s["prompt"] for s in sentences)


def _q(kind: str, hit: bool) -> dict:
    return {"kind": kind, "hit": hit}


def test_the_estimates_are_the_cards_arithmetic():
    card = [_q("other words", True), _q("other words", False), _q("table", True)]
    pool = card + [_q("reverse", False)]
    colleagues = [_q("as written", True), _q("other words", False), _q("other words", False),
                  _q("reverse", True)]
    e = estimates(card, pool, colleagues)
    assert e["colleague"] == 50.0 and e["card"] == pytest.approx(200 / 3)
    # The forward half right counts a third each (odds 0.5): (2/3 + 1) of 3.
    assert e["card_headline"] == pytest.approx(100 * (2 / 3 + 1) / 3)
    assert e["pool"] == 50.0
    # Colleagues asked three forward, one reverse: the pool's forward half and reverse 0.
    assert e["colleague_mix"] == pytest.approx(100 * (3 * 0.5 + 0) / 4)
    assert e["colleague_by_kind"] == {"other words": "1/3", "reverse": "1/1"}
