"""Practice for sentences without a fact (scripts/experiments/plain_sentences.py): asked by
their paragraph's heading and to be completed, answered with the whole sentence; fact
sentences, headings and fragments left to the job's own practice."""

from __future__ import annotations

from scripts.experiments.plain_sentences import plain_practice, practising_plain_sentences
from worker.dataset import build
from worker.dataset.colleague import make_probes
from worker.dataset.probes import fact_spans, normalise

DOC = ("staff_handbook.pdf",
       ("Shifts and hours. The rota for the following week is posted every Tuesday by your "
       "shop lead. Full-time staff work 39 hours a week over five shifts.\n\n"
       "Safety. Record every injury, however small, in the red accident book kept beside "
       "the till. Wear boots."))


def test_sentences_without_a_fact_are_asked_and_answered_whole():
    practised = {f.sentence for f in fact_spans([DOC])}
    assert "Full-time staff work 39 hours a week over five shifts." in practised
    pairs = plain_practice([DOC], 2, practised)
    rota = "The rota for the following week is posted every Tuesday by your shop lead."
    injury = ("Record every injury, however small, in the red accident book kept beside the "
              "till.")
    assert pairs == [
        ("What does the staff handbook say about shifts and hours?", rota),
        (("Complete this sentence from the staff handbook: The rota for the following week "
         "is"), rota),
        ("What does the staff handbook say about safety?", injury),
        (("Complete this sentence from the staff handbook: Record every injury, however "
         "small, in the"), injury),
    ]  # not the fact sentence, the headings, nor "Wear boots." (a fragment)
    assert plain_practice([DOC], 1, practised) == [pairs[0], pairs[2]]
    assert plain_practice([DOC], 0, practised) == []


def test_the_builder_practises_them_only_while_asked_and_never_a_card_question():
    probes = make_probes([DOC], max_probes=40, seed=0)
    plain = build.make_generated_qa([DOC], probes, 2)
    with practising_plain_sentences(2):
        more = build.make_generated_qa([DOC], probes, 2)
    assert more[: len(plain)] == plain and len(more) == len(plain) + 4
    assert build.make_generated_qa([DOC], probes, 2) == plain  # put back
    card = {normalise(p.question) for p in probes if p.question}
    assert not card & {normalise(q) for q, _ in more}


def test_plain_sentences_is_a_recipe_setting():
    from scripts.experiments.recall import _known

    assert _known("default+plain_sentences=2") and not _known("default+plain_sentences=5")
