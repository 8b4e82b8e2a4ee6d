"""The advice experiment's groups (scripts/experiments/advice.py): each FAQ pair is about one
missed colleague fact and says it, never in the colleague question's words; the control and
the facts that already had pairs are other colleague facts."""

from __future__ import annotations

from scripts.experiments.advice import CONTROL, FAQ, HAD_PAIRS, colleague_facts, tally
from worker.dataset.colleague import shared_words
from worker.dataset.probes import gives_answer


def test_each_pair_gives_its_fact_in_its_own_words():
    facts = {f.answer: f for f in colleague_facts([fact for _, _, fact in FAQ])}
    assert len(facts) == len(FAQ) == 12
    for question, answer, fact in FAQ:
        assert gives_answer(answer, fact)
        colleague = facts[fact].question
        assert question != colleague and len(shared_words(question, colleague)) <= 3, question


def test_the_groups_are_disjoint_colleague_facts():
    groups = [[fact for _, _, fact in FAQ], CONTROL, HAD_PAIRS]
    answers = [a for g in groups for a in g]
    assert len(answers) == len(set(answers))
    assert all(len(colleague_facts(g)) == len(g) for g in groups)


def test_tally_counts_the_groups_colleague_questions_only():
    items = [{"kind": "other words", "answer": "37.5", "hit": True},
             {"kind": "as written", "answer": "37.5", "hit": True},
             {"kind": "reverse", "answer": "Gale Fan", "hit": False}]
    assert tally(items, CONTROL) == "1/2" and tally(items, HAD_PAIRS) == "0/0"
