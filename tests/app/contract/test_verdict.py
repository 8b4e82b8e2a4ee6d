"""The verdict in words, for each kind of outcome a job can have."""

from __future__ import annotations

import pytest

from app.contract.scores import forgetting, headline_recall
from app.contract.verdict import (
    FORGETTING_RISE,
    MOSTLY_WRONG,
    OPEN_BOOK,
    SAFE_RECALL,
    verdict,
    wilson_lower,
)


def side(hits: int, n: int = 40, general: float | None = 20.0, ppl: float = 30.0, **kw) -> dict:
    return {
        "perplexity": ppl,
        "n_probes": n,
        "n_recalled": max(0, hits - 1),  # completions: a different count than questions
        "questions": {"n": n, "n_recalled": hits, "recall": hits / n if n else None},
        "general": {"perplexity": general} if general is not None else None,
        **kw,
    }


def kinded(tally: dict[str, tuple[int, int]], **kw) -> dict:
    """A side whose questions carry kinds: {kind: (hits, n)}; question ids run across kinds,
    so the same tally order gives the same questions before and after."""
    items = [
        {"question": f"{kind} question {i}?", "answer": f"A{i}", "kind": kind, "hit": i < hits}
        for kind, (hits, n) in tally.items()
        for i in range(n)
    ]
    n, hits = len(items), sum(i["hit"] for i in items)
    out = side(hits, n, **kw)
    out["questions"]["items"] = items
    return out


PARAMS = {"method": "lora", "epochs": 8, "learning_rate": 2e-4}
FORGOT = 20.0 * (1 + FORGETTING_RISE) + 1  # general-text perplexity: forgetting (from 20.0)


def test_learned_and_safe():
    v = verdict(side(0), side(31), PARAMS)
    assert v.headline == "Learned 31 of 40 facts (was 0). Safe to use."
    assert v.level == "good" and v.ok
    assert any("31 of 40 questions about your documents" in d for d in v.details)
    assert any("no sign of forgetting" in d for d in v.details)


def test_too_few_questions_to_call_it_safe():
    # 6 of 10 is SAFE_RECALL, but ten questions cannot rule out a model that is mostly wrong.
    v = verdict(side(0, n=10), side(6, n=10), PARAMS)
    assert v.level == "partial" and not v.ok
    assert v.headline == (
        "Answers 6 of 10 questions about your documents correctly (was 0). Not sure yet: 10 "
        "are too few to tell a ready model from one that is often wrong."
    )
    assert v.advice[0].startswith("Check the side-by-side answers below before you rely on it")
    assert v.advice[-1] == OPEN_BOOK
    assert verdict(side(0, n=10), side(7, n=10), PARAMS).level == "good"
    assert verdict(side(0, n=6), side(5, n=6), PARAMS).level == "good"
    assert verdict(side(0, n=6), side(4, n=6), PARAMS).level == "partial"
    # An older job measured by sentence completions says it in its own words.
    completions = {"perplexity": 30.0, "n_probes": 10, "general": {"perplexity": 20.0}}
    v = verdict(completions | {"n_recalled": 0}, completions | {"n_recalled": 6}, PARAMS)
    assert v.headline.startswith("Fills in 6 of 10 facts from your documents (was 0). Not sure")


@pytest.mark.parametrize(
    ("hits", "n", "lower"),
    # Wilson score intervals at 90%: 6 of 10 runs from 35% to 81%.
    [(6, 10, 0.3516), (24, 40, 0.4700), (18, 29, 0.4684), (5, 5, 0.6487), (0, 8, 0.0)],
)
def test_the_confidence_bound(hits, n, lower):
    assert wilson_lower(hits, n) == pytest.approx(lower, abs=5e-4)
    # The bound is where the observed rate is z standard errors away: (p^ - p)^2 = z^2 p(1-p)/n.
    p, z = wilson_lower(hits, n), 1.645
    assert (hits / n - p) ** 2 == pytest.approx(z * z * p * (1 - p) / n, abs=1e-9)
    # Every card of 29 questions or more that reaches SAFE_RECALL clears the bound.
    for size in range(29, 101):
        hits_needed = -(-int(SAFE_RECALL * 100) * size // 100)
        assert wilson_lower(hits_needed, size) >= MOSTLY_WRONG


def test_barely_changed():
    v = verdict(side(0), side(1), PARAMS)
    assert v.headline == "Barely changed: add more documents or train longer."
    assert v.level == "barely" and not v.ok
    assert "Train longer (for example 16 epochs instead of 8)." in v.advice
    assert any("question-answer pairs" in a for a in v.advice)
    assert any("raise the learning rate (for example to 0.0005)" in a for a in v.advice)


def test_a_small_gain_on_many_probes_is_still_barely():
    assert verdict(side(0, n=100), side(9, n=100)).level == "barely"  # under 10%
    assert verdict(side(0, n=100), side(10, n=100)).level == "partial"


def test_partly_learned_says_plainly_what_it_cannot_do_yet():
    v = verdict(side(1), side(12), PARAMS)
    assert v.level == "partial" and not v.ok
    assert v.headline == (
        "Answers 12 of 40 questions about your documents correctly (was 1). Not ready: a "
        "colleague would get a wrong answer most of the time."
    )
    # Older scores (no kinds): what to add, without naming kinds.
    assert v.advice == [
        (
            "Add question-answer pairs (CSV or JSONL) for the facts it misses, and write each "
            "question the several ways your colleagues would ask it: the model learns a question "
            "as it is written, much less the same fact asked in other words."
        ),
        (
            "Until then, ask it in DocTune's chat with \"Use my documents\" on: it answers about as "
            "often, and shows the passages each answer drew on, so a colleague can check the "
            "answer."
        ),
    ]
    # More epochs are not advised to a model that learned something: measured, they added
    # no colleague answers to the default and cost general English.
    assert not any("Train longer" in a or "epochs" in a for a in v.advice)
    assert not any("By how the questions were put" in d for d in v.details)
    assert verdict(side(0), side(20), PARAMS).headline.endswith(  # 50%: wrong often, not mostly
        "Not ready: a colleague would get a wrong answer often."
    )


def test_safe_to_use_needs_sixty_percent_and_no_forgetting():
    assert SAFE_RECALL == 0.6
    good = verdict(side(0), side(24), PARAMS)  # 60%
    assert good.level == "good" and good.headline == "Learned 24 of 40 facts (was 0). Safe to use."
    short = verdict(side(0), side(22), PARAMS)  # 55%
    assert short.level == "partial" and "safe" not in short.headline.lower()
    assert short.headline.startswith("Answers 22 of 40 questions")
    for hits in (24, 32, 40):
        v = verdict(side(0), side(hits, general=FORGOT), PARAMS)
        assert v.level == "forgetting" and not v.ok
        assert not any("safe" in line.lower() for line in [v.headline, *v.advice, *v.details])


# 9 of 40 right after training: other words 3 of 22, reverse 1 of 10, table 5 of 8.
MISSES = {"other words": (3, 22), "reverse": (1, 10), "table": (5, 8)}
NOTHING = {kind: (0, n) for kind, (_, n) in MISSES.items()}


def test_partial_names_the_kinds_it_handles_and_misses_and_what_to_add():
    v = verdict(kinded(NOTHING), kinded(MISSES), PARAMS)
    assert v.level == "partial"
    assert v.headline == (
        "Answers 9 of 40 questions about your documents correctly (was 0). Not ready: a "
        "colleague asking in their own words would get about 19% right."
    )
    assert v.advice[0] == (
        "It answers questions looked up in a table (5 of 8) but rarely questions asked in the "
        "documents' own terms (3 of 22) or asked the other way round (1 of 10). Add "
        "question-answer pairs (CSV or JSONL) for the facts it misses, including questions "
        "asked in the documents' own terms and asked the other way round, and write each question the "
        "several ways your colleagues would ask it: the model learns a question as it is "
        "written, much less the same fact asked in other words."
    )
    assert v.advice[1].startswith("Until then, ask it in DocTune's chat with \"Use my documents\" on")
    assert v.details[1] == (
        "By how the questions were put: 22 asked in the documents' own terms: 3 right (was 0); "
        "10 asked the other way round: 1 right (was 0); 8 looked up in a table: 5 right (was 0)."
    )

    # Nothing answered well: each kind it misses, by how often.
    v = verdict(
        kinded(NOTHING), kinded({"other words": (8, 22), "reverse": (1, 10), "table": (4, 8)})
    )
    assert v.level == "partial"
    assert v.advice[0].startswith(
        "It only sometimes answers questions asked in the documents' own terms (8 of 22) or looked up "
        "in a table (4 of 8), and rarely questions asked the other way round (1 of 10)."
    )


def test_safe_to_use_is_judged_on_what_a_colleague_would_see():
    """25 of 40 (62%) is over SAFE_RECALL, but most are forward questions in the documents'
    own terms, which colleagues asking in their own words get right less often: about 51%
    (app.contract.scores.colleague_share). Not called safe."""
    tally = {"other words": (20, 28), "reverse": (2, 6), "table": (3, 6)}
    v = verdict(kinded({k: (0, n) for k, (_, n) in tally.items()}), kinded(tally), PARAMS)
    assert v.level == "partial" and not v.ok
    assert v.headline == (
        "Answers 25 of 40 questions about your documents correctly (was 0). Not ready: a "
        "colleague asking in their own words would get about 51% right."
    )
    # The same 25 of 40 without kinds (an older job) is judged on the share right.
    assert verdict(side(0), side(25), PARAMS).level == "good"
    # All forward questions right: a colleague would get them too (the odds leave all as all).
    full = {"other words": (28, 28), "reverse": (4, 6), "table": (4, 6)}
    v = verdict(kinded({k: (0, n) for k, (_, n) in full.items()}), kinded(full), PARAMS)
    assert v.level == "good"
    assert v.headline == (
        "Learned 36 of 40 facts (was 0). A colleague asking in their own words would get about "
        "90% right. Safe to use."
    )


def test_safe_but_weak_on_one_kind_says_which():
    tally = {"other words": (20, 22), "reverse": (2, 10), "table": (8, 8)}  # 30 of 40
    v = verdict(kinded(NOTHING), kinded(tally), PARAMS)
    assert v.level == "good" and v.headline.endswith("Safe to use.")
    assert v.advice[0].startswith(
        "It answers questions asked in the documents' own terms (20 of 22) and looked up in a table "
        "(8 of 8) but rarely questions asked the other way round (2 of 10). Add question-answer "
        "pairs (CSV or JSONL) for the facts it misses, including questions asked the other way "
        "round, and write each question"
    )
    assert not any("Use my documents" in a for a in v.advice)  # safe to use: no stopgap


def test_forgetting_is_flagged_in_words():
    v = verdict(side(0, general=20.0), side(30, general=FORGOT), PARAMS)
    assert v.level == "forgetting" and not v.ok
    assert v.headline == (
        "Learned 30 of 40 facts (was 0), but the model got worse at general English; "
        "try fewer epochs."
    )
    assert any("for example 4 instead of 8" in a for a in v.advice)
    assert any("got worse at ordinary text" in d for d in v.details)


def test_forgetting_below_safe_recall_also_says_not_ready():
    v = verdict(side(0, general=20.0), side(10, general=FORGOT), PARAMS)
    assert v.level == "forgetting"
    assert v.headline == (
        "Answers 10 of 40 questions about your documents correctly (was 0). Not ready: a "
        "colleague would get a wrong answer most of the time. It also got worse at general "
        "English."
    )
    assert any("Add question-answer pairs" in a for a in v.advice)
    assert any("Use my documents" in a for a in v.advice)
    assert any("fewer epochs" in a for a in v.advice)


def test_worse_than_before():
    v = verdict(side(20), side(5), PARAMS)
    assert v.level == "worse"
    assert v.headline == "Got worse: recalls 5 facts of 40, down from 20. Do not use it."
    assert any("lower learning rate (for example 0.0001)" in a for a in v.advice)


def test_no_facts_says_why_recall_was_not_measured():
    v = verdict(side(0, n=0), side(0, n=0), PARAMS)
    assert v.level == "unmeasured"
    assert "recall could not be measured" in v.headline
    assert "no sentence in the documents states a distinctive fact" in v.details[0]
    assert any("question-answer pairs" in a for a in v.advice)


def test_old_scores_without_questions_use_the_completions():
    before = {"n_probes": 10, "n_recalled": 1, "perplexity": 40.0}
    after = {"n_probes": 10, "n_recalled": 8, "perplexity": 12.0}
    fig = headline_recall(before, after)
    assert (fig.kind, fig.n, fig.before, fig.after) == ("completion", 10, 1, 8)
    v = verdict(before, after)
    assert v.headline == "Learned 8 of 10 facts (was 1). Safe to use."
    assert forgetting(before, after) is None  # no general sample: nothing claimed
    assert not any("General English" in d for d in v.details)


def test_overfitting_and_own_questions_are_reported():
    before = side(0, ppl=20.0, qa={"n": 4, "f1": 0.1, "exact": 0.0})
    after = side(25, ppl=45.0, qa={"n": 4, "f1": 0.55, "exact": 0.5})
    v = verdict(before, after)
    assert any("rose from 20.0 to 45.0" in d for d in v.details)
    assert any("word overlap 10% → 55% (4 questions)" in d for d in v.details)
    assert any("fewer epochs" in a for a in v.advice)


@pytest.mark.parametrize("scores", [None, {}, {"questions": None}])
def test_missing_parts_do_not_crash(scores):
    assert verdict(scores, scores).level == "unmeasured"
