"""Practice for the sentences that hold no distinctive span (an experiment:
`--recipes default+plain_sentences=N`).

A job practises only the sentences with a number, code, name or date in them
(worker.dataset.probes.fact_spans): "The rota for the following week is posted every Tuesday
by your shop lead." or "Record every injury, however small, in the red accident book kept
beside the till." are read in the text and never asked. The recall runs of 2026-12-07
(scripts/experiments/coverage.py) found no colleague question ever answered whose answer the
model only read (0 of 32 over three companies); the practised ones, 13-40%. Here each such
sentence is practised in up to N phrasings, answered with the whole sentence: what its
paragraph's heading is about ("What does the staff handbook say about holiday?", the first
sentence under a heading only), and the sentence to complete from its first half.

Never a card question: the card asks only sentences with a span (and tables and jobs), and a
practice question equal to one of its questions is left out all the same.
"""

from __future__ import annotations

import contextlib
import re

_MIN_WORDS = 5  # a shorter sentence is a heading or a fragment, not a statement
_HEADING_WORDS = 4  # a paragraph's first sentence this short, with more after it: its heading


def _paragraph_sentences(text: str) -> list[tuple[str | None, list[str]]]:
    """(the heading, the sentences after it) of each paragraph (heading None where there
    is none: every sentence then)."""
    from worker.dataset.probes import split_sentences

    out = []
    for para in re.split(r"\n\s*\n", text):
        sentences = split_sentences(para)
        if len(sentences) > 1 and len(sentences[0].split()) <= _HEADING_WORDS:
            out.append((sentences[0].rstrip(".:!? ").strip(), sentences[1:]))
        elif sentences:
            out.append((None, sentences))
    return out


def plain_practice(docs: list[tuple[str, str]], per_sentence: int,
                   practised: set[str]) -> list[tuple[str, str]]:
    """Up to `per_sentence` (question, whole sentence) pairs for each usable sentence of
    `docs` ((name, text)) that is not in `practised` (the fact sentences)."""
    from worker.dataset.probes import usable_sentence
    from worker.dataset.questions import title_of

    out: list[tuple[str, str]] = []
    if per_sentence <= 0:
        return out
    for name, text in docs:
        title = title_of(name)
        for heading, sentences in _paragraph_sentences(text):
            for i, s in enumerate(sentences):
                words = s.split()
                if s in practised or len(words) < _MIN_WORDS or not usable_sentence(s):
                    continue
                made = []
                if heading and i == 0:
                    made.append(f"What does {title} say about {heading.lower()}?")
                half = max(3, len(words) // 2)
                if len(words) - half >= 2:
                    made.append(f"Complete this sentence from {title}: {' '.join(words[:half])}")
                out += [(q, s) for q in made[:per_sentence]]
    return out


@contextlib.contextmanager
def practising_plain_sentences(per_sentence: int):
    """The dataset builder also practising the sentences without a fact (the trained
    documents', not the question-answer pairs'), after its own practice."""
    from worker.dataset import build
    from worker.dataset.probes import fact_spans, normalise

    saved = build.make_generated_qa

    def with_plain(docs, probes, per_fact, answers=()):
        out = saved(docs, probes, per_fact, answers=answers)
        taken = {normalise(q) for q, _ in out} | {normalise(p.question) for p in probes
                                                  if p.question}
        practised = {f.sentence for f in fact_spans(docs)}
        for q, a in plain_practice(docs, per_sentence, practised):
            if normalise(q) not in taken:
                taken.add(normalise(q))
                out.append((q, a))
        return out

    if per_sentence > 0:
        build.make_generated_qa = with_plain
    try:
        yield
    finally:
        build.make_generated_qa = saved
