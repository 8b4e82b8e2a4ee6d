"""Which colleague questions the training could teach (scripts/experiments/coverage.py): an
answer the model is asked to write, one it only reads in the text, one it never sees; and a
run's replies tallied by those classes."""

from __future__ import annotations

from scripts.experiments.coverage import classify, tally, trained_sides
from worker.dataset.build import encode_qa, encode_text
from worker.dataset.corpus import answer_example, text_example


def test_answers_and_text_of_training_examples(smol_tokenizer):
    ids, n_prompt = encode_qa(smol_tokenizer, "How long is the warranty?",
                              "The warranty lasts seven years.")
    examples = [answer_example(ids, n_prompt),
                text_example(encode_text(smol_tokenizer, "Bin K-13 holds the descaler."))]
    answers, texts = trained_sides(smol_tokenizer, examples)
    assert [a.strip() for a in answers] == ["The warranty lasts seven years."]
    assert [t.strip() for t in texts] == ["Bin K-13 holds the descaler."]


def test_classes_by_where_the_answer_is_trained():
    answers = ["The warranty lasts seven years.", "Keep the sheets for 7 years.",
               "Call 01632 960 418."]
    texts = ["Bin K-13 holds the descaler. Probes are in K-24."]
    assert classify("7 years", answers, texts) == ("practised", 2)  # values written one way
    assert classify("K-13", answers, texts) == ("text only", 0)
    assert classify("K-2", answers, texts) == ("not trained", 0)  # not from a piece of K-24
    assert classify("SG-2041", answers, texts) == ("not trained", 0)


def test_a_runs_replies_tallied_by_class():
    rows = [
        {"class": "practised", "times": 1, "kind": "as written", "hit": True},
        {"class": "practised", "times": 5, "kind": "reverse", "hit": False},
        {"class": "practised", "times": 2, "kind": "as written", "hit": False},
        {"class": "text only", "times": 0, "kind": "table", "hit": False},
    ]
    t = tally(rows)
    assert t["practised"] == {"n": 3, "right": 1,
                              "by_kind": {"as written": "1/2", "reverse": "0/1"}}
    assert t["text only"] == {"n": 1, "right": 0, "by_kind": {"table": "0/1"}}
    assert t["not trained"] == {"n": 0}
    assert t["practised_by_times"] == {"1": "1/1", "2-3": "0/1", "4+": "0/1"}
    # without a run's replies: the classes only
    assert tally([{k: v for k, v in r.items() if k != "hit"} for r in rows])["practised"] == {
        "n": 3}
