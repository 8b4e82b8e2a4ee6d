"""The recall experiment's quoting practice answers (scripts/experiments/quoted.py)."""

from __future__ import annotations

from scripts.experiments.quoted import QUOTED_TEMPLATES, quoted, quoting
from worker.dataset import build
from worker.dataset.probes import fact_spans

DOC = ("employee_handbook.pdf",
       "Every employee receives 27 days of paid annual leave. Our core hours are 10:00 to 15:00.")


def test_sentence_answers_quote_their_document_and_the_rest_stay():
    plain = build.make_generated_qa([DOC], [], 5)
    with quoting(True):
        quoted_pairs = build.make_generated_qa([DOC], [], 5)
    assert build.training_questions.__name__ == "training_questions"  # put back
    assert [q for q, _ in quoted_pairs] == [q for q, _ in plain]
    changed = [(a, b) for (_, a), (_, b) in zip(plain, quoted_pairs, strict=True) if a != b]
    assert changed and len(changed) < len(plain)  # the blanks and completions keep theirs
    for before, after in changed:
        assert after == f'The employee handbook says: "{before}"'
    sentences = {f.sentence for f in fact_spans([DOC])}
    assert {b for b, _ in changed} <= sentences
    with quoting(False):
        assert build.make_generated_qa([DOC], [], 5) == plain
    assert set(QUOTED_TEMPLATES) <= set(build._TEMPLATE_ORDER)
    assert quoted("our documents", "X.") == 'Our documents say: "X."'
