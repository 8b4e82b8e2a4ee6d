"""The score card with everything the worker measures: questions in chat, completions,
the forgetting check, side by side, the user's own questions, and the verdict."""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from typing import Any

from app.db import session_scope
from app.models import JobState
from app.services.score_card import score_card, score_summary

from .factories import make_job, make_project


def full_scores(
    n: int = 10,
    before_hits: int = 0,
    after_hits: int = 8,
    general: tuple[float, float] = (20.0, 21.0),
    qa: bool = True,
) -> dict[str, Any]:
    """Scores as worker.scoring.evaluate writes them (one dict per side)."""

    def side(hits: int, tuned: bool) -> dict[str, Any]:
        items = [
            {
                "question": f"How long is the warranty on model X{i}?",
                "answer": f"{20 + i} months",
                "output": f"It is {20 + i} months." if i < hits else "I am not sure.",
                "hit": i < hits,
                "source": "manual.pdf",
                "sentence": f"Model X{i} has a warranty of {20 + i} months.",
                "template": "fronted",
            }
            for i in range(n)
        ]
        return {
            "probe_set": "abc123",
            "perplexity": 12.0 if tuned else 40.0,
            "n_heldout_chunks": 3,
            "recall": (hits // 2) / n if n else None,
            "n_probes": n,
            "n_recalled": hits // 2,
            "probes": [
                {
                    "prompt": f"Model X{i} has a warranty of",
                    "answer": f"{20 + i} months",
                    "output": "?",
                    "hit": i < hits // 2,
                    "source": "manual.pdf",
                }
                for i in range(n)
            ],
            "questions": {
                "n": n,
                "n_recalled": hits,
                "recall": hits / n if n else None,
                "items": items,
            },
            "general": {"perplexity": general[1] if tuned else general[0], "n_paragraphs": 6},
            "qa": {
                "n": 2 if qa else 0,
                "f1": 0.6 if tuned else 0.1,
                "exact": 0.5 if tuned else 0.0,
                "items": [
                    {
                        "question": "Can I return an item?",
                        "answer": "Yes, within 45 days.",
                        "output": "Yes, within 45 days." if tuned else "No.",
                        "f1": 1.0 if tuned else 0.0,
                        "contains": tuned,
                    },
                    {
                        "question": "Where is it made?",
                        "answer": "In Port Ellery.",
                        "output": "Somewhere.",
                        "f1": 0.0,
                        "contains": False,
                    },
                ]
                if qa
                else [],
            },
        }

    return {"before": side(before_hits, False), "after": side(after_hits, True)}


def with_kinds(scores: dict[str, Any], kinds: Sequence[str]) -> dict[str, Any]:
    """The scores with question i put as kinds[i] on both sides, as newer jobs record it."""
    for side in ("before", "after"):
        for item, kind in zip(scores[side]["questions"]["items"], kinds, strict=True):
            item["kind"] = kind
    return scores


# 10 questions; the first `hits` are answered right (full_scores), so after 5 hits: table
# 3 of 3, other words 2 of 4, reverse 0 of 3.
KINDS = ["table"] * 3 + ["other words"] * 4 + ["reverse"] * 3
KINDS_LINE = (
    "Asked 10 questions: 4 asked in the documents' own terms (2 right, was 0), 3 asked the other way "
    "round (0 right, was 0), 3 looked up in a table (3 right, was 1)."
)


DATASET = {"n_probes": 10, "notes": ["10 recall probes from 1 document(s)."]}


PARAMS = {"method": "lora", "epochs": 8, "learning_rate": 2e-4}


def test_headline_is_the_questions_and_side_by_side_has_five():
    card = score_card(full_scores(), params=PARAMS)
    assert card.recall_kind == "questions"
    assert (card.recall_before.n_recalled, card.recall_after.n_recalled) == (0, 8)
    assert (card.completion_before.n_recalled, card.completion_after.n_recalled) == (0, 4)
    assert len(card.side_by_side) == 5
    first = card.side_by_side[0]
    assert first.tuned_hit and not first.base_hit  # learned facts first
    assert first.sentence == "Model X0 has a warranty of 20 months."
    assert first.prompt == "How long is the warranty on model X0?"
    assert card.general_before == 20.0 and not card.forgetting
    assert card.verdict.headline == "Learned 8 of 10 facts (was 0). Safe to use."
    assert [r.question for r in card.qa_rows] == ["Can I return an item?", "Where is it made?"]
    assert card.qa_rows[0].tuned_hit and not card.qa_rows[0].base_hit
    assert score_summary(full_scores()) == "Recall 0% → 80%"


def test_the_card_counts_each_kind_of_question_before_and_after():
    card = score_card(with_kinds(full_scores(before_hits=1, after_hits=5), KINDS), params=PARAMS)
    assert [(k.kind, k.n, k.before, k.after) for k in card.kinds] == [
        ("other words", 4, 0, 2), ("reverse", 3, 0, 0), ("table", 3, 1, 3)
    ]
    assert card.kinds_line == KINDS_LINE
    # 5 of 10 is below a safe recall: the verdict names the kinds it misses.
    assert card.verdict.level == "partial"
    assert card.verdict.advice[0].startswith(
        "It answers questions looked up in a table (3 of 3) but only sometimes questions asked "
        "in the documents' own terms (2 of 4) and rarely questions asked the other way round "
        "(0 of 3)."
    )


def test_side_by_side_mixes_the_kinds_and_shows_a_miss():
    # After 5 hits: the three table questions and two in other words are right; a sample of
    # the first five would show only answers the model got right.
    card = score_card(with_kinds(full_scores(before_hits=0, after_hits=5), KINDS), params=PARAMS)
    kinds = [r.kind for r in card.side_by_side]
    assert len(kinds) == 5 and set(kinds) == {"table", "other words", "reverse"}
    assert any(not r.tuned_hit for r in card.side_by_side)
    # Without kinds (an older job) it is the learned facts first, and still one miss.
    rows = score_card(full_scores(before_hits=0, after_hits=8), params=PARAMS).side_by_side
    assert [r.tuned_hit for r in rows] == [True, True, True, True, False]


def test_an_older_job_without_kinds_has_no_per_kind_line():
    card = score_card(full_scores(), params=PARAMS)
    assert card.kinds == [] and card.kinds_line == ""


def test_forgetting_is_flagged():
    card = score_card(full_scores(general=(20.0, 30.0)), params=PARAMS)
    assert card.forgetting and card.general_rise == 0.5
    assert card.verdict.level == "forgetting"


def _page(client, scores, project_name: str = "Score card") -> str:
    with session_scope() as session:
        project = make_project(session, project_name)
        job = make_job(session, project, JobState.done, scores=scores, dataset=DATASET)
        job_id = job.id
    page = client.get(f"/jobs/{job_id}")
    assert page.status_code == 200
    return page.text


def test_job_page_shows_verdict_side_by_side_and_forgetting_check(client):
    text = _page(client, full_scores(general=(20.0, 30.0)))
    for expected in (
        (
            "Learned 8 of 10 facts (was 0), but the model got worse at general English; "
            "try fewer epochs."
        ),
        "What to try next:",
        "for example 4 instead of 8",
        "Forgetting check",
        "The model got worse at general English</strong> (+50%)",
        "Side by side: 5 of the 10 questions",
        "How long is the warranty on model X0?",
        "Model X0 has a warranty of 20 months.",
        "It is 20 months.",
        "Completing the sentences themselves: 0 → 4 of 10.",
        "Your own questions, before and after (2 of 2)",
        "Can I return an item?",
        "How the verdict was reached",
        "10 recall probes from 1 document(s).",  # the notes, from Job.dataset
    ):
        assert expected in text, expected
    assert text.count('class="source-sentence"') == 5


def test_job_page_says_how_many_of_each_kind_it_asked(client):
    text = _page(client, with_kinds(full_scores(before_hits=1, after_hits=5), KINDS))
    assert "the documents&#39; own terms (2 right, was 0)" in text  # escaped like all text
    text = html.unescape(text)
    assert KINDS_LINE in text
    assert "None of these questions was trained on." in text
    assert "Facts put in ordinary words (who signs off leave: “your manager”) are not asked" in text
    assert "the other way round (“What has a lifetime warranty?”)" in text
    assert (
        "Answers 5 of 10 questions about your documents correctly (was 1). Not ready: a colleague "
        "asking in their own words would get about 43% right."
    ) in text
    # The figure it leads with is that estimate, not the 5 of 10 (50%): table 3 of 3 and
    # reverse 0 of 3 as answered, the forward 2 of 4 at colleagues' odds (a third).
    assert "The share of a colleague's questions it would answer, estimated from 5 of 10" in text
    values = text.split('class="metric-values"', 1)[1].split("</p>", 1)[0]
    assert "10%" in values and "43%" in values and "50%" not in values
    assert "How often are laptops replaced?" in text
    assert "rarely questions asked the other way round (0 of 3)" in text

    # An older job: no kinds, no such line, and the explanation says what its questions were.
    old = html.unescape(_page(client, full_scores(), "Older job"))
    assert "Asked 10 questions" not in old and "kinds-line" not in old
    assert "None of these questions was trained on." not in old
    assert "they stay close to the documents' own sentences" in old


def test_a_job_without_facts_says_why_recall_was_not_measured(client):
    scores = full_scores(n=0, before_hits=0, after_hits=0, qa=False)
    text = _page(client, scores)
    assert "No facts to check: recall could not be measured." in text
    assert "no sentence in your documents states a distinctive fact" in text
    assert "Side by side" not in text


def with_previous(scores: dict[str, Any], hits: int = 4) -> dict[str, Any]:
    """An incremental job's scores: the version it started from, measured like "after"."""
    previous = full_scores(after_hits=hits)["after"]
    previous["perplexity"] = 18.5
    previous["general"] = {"perplexity": 20.5, "n_paragraphs": 6}
    previous["qa"]["f1"] = 0.35
    return scores | {"previous": previous}


def test_the_card_carries_the_previous_version_with_the_headline_recall():
    card = score_card(with_previous(full_scores()), params=PARAMS, previous_label="v2")
    assert card.has_previous and card.previous_label == "v2"
    # The headline is the questions: 4 of 10 questions, not the 2 of 10 completions.
    assert (card.recall_previous.n_recalled, card.recall_previous.n_probes) == (4, 10)
    assert card.recall_previous.pct == 40.0
    assert (card.perplexity_previous, card.general_previous) == (18.5, 20.5)
    assert card.qa_f1_previous == 0.35
    assert score_summary(with_previous(full_scores())) == "Recall 0% → 80% (previous version 40%)"

    # Completion-only scores (no questions asked): the previous recall is the completions'.
    scores = full_scores()
    for side in ("before", "after"):
        del scores[side]["questions"]
    card = score_card(with_previous(scores))
    assert card.recall_kind == "completion"
    assert (card.recall_previous.n_recalled, card.recall_previous.n_probes) == (2, 10)
    assert score_summary(with_previous(scores)) == "Recall 0% → 40% (previous version 20%)"

    plain = score_card(full_scores(), params=PARAMS)
    assert not plain.has_previous and plain.recall_previous is None
    assert plain.perplexity_previous is None and plain.general_previous is None


_PREVIOUS = re.compile(
    r'class="metric-detail metric-previous">Previous version ?([^:]*):\s*'
    r'<strong class="previous">([^<]*)</strong>'
)


def test_job_page_shows_the_previous_version_for_each_metric(client):
    with session_scope() as session:
        project = make_project(session, "Incremental")
        v1 = make_job(session, project, JobState.done, scores=full_scores())
        v2 = make_job(
            session, project, JobState.done, parent_job_id=v1.id,
            scores=with_previous(full_scores()),
        )
        v1_id, v2_id = v1.id, v2.id
    text = client.get(f"/jobs/{v2_id}").text
    # Recall, held-out perplexity, forgetting check, the user's questions: each with v1's.
    assert _PREVIOUS.findall(text) == [
        ("v1", "40%"), ("v1", "18.5"), ("v1", "20.5"), ("v1", "35%")
    ]
    assert "(4 of 10 facts)" in text
    assert "This training continued v1" in text

    text = client.get(f"/jobs/{v1_id}").text  # started from the base model: no third value
    assert _PREVIOUS.findall(text) == [] and "Previous version" not in text
    assert "This training continued" not in text


def test_scores_of_another_shape_show_no_card_rather_than_an_error(client):
    broken = full_scores()
    broken["after"]["n_probes"] = "many"  # not what worker.scoring writes
    text = _page(client, broken)
    assert "no scores were recorded for this job" in text and "Did it get better?" not in text
    assert score_summary(broken) is None
