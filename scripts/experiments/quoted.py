"""Practice answers that quote the document (an experiment: `--recipes default+quote=true`).

A practice answer today is the fact's sentence as the answer ("Every employee receives 27
days of paid annual leave."), and the questions it answers mostly share its words, so the
model learns to echo the question and fill in a value: asked in other words ("How many days
a week am I allowed to work from home?") it echoes those words and invents the value. Here
the answer names its document and quotes the sentence (*The employee handbook says: "Staff
may work from home up to two days a week."*), as recitation-augmented answering does (Sun
et al. 2022, "Recitation-Augmented Language Models"): the model learns to answer by
reciting what it read, and a recited sentence continues the way the document did (the card's
sentence completions are answered more often than its questions). The fill-in-the-blank and
completion practice keep their answers: they ask for a span or the sentence itself.
"""

from __future__ import annotations

import contextlib

QUOTED_TEMPLATES = ("echo", "topic", "fronted")


def quoted(title: str, sentence: str) -> str:
    """'The employee handbook says: "..."' for title "the employee handbook"."""
    verb = "say" if title == "our documents" else "says"  # title_of's name for no name
    return f'{title[:1].upper()}{title[1:]} {verb}: "{sentence}"'


@contextlib.contextmanager
def quoting(on: bool):
    """The dataset builder with the practice answers of QUOTED_TEMPLATES quoting their
    document (worker.dataset.questions.title_of names it)."""
    from worker.dataset import build
    from worker.dataset.questions import title_of

    saved = build.training_questions

    def with_quotes(fact, probed):
        return [(t, q, quoted(title_of(fact.source), a) if t in QUOTED_TEMPLATES else a)
                for t, q, a in saved(fact, probed)]

    if on:
        build.training_questions = with_quotes
    try:
        yield
    finally:
        build.training_questions = saved
