"""The recall experiment's thesaurus rewording of practice questions
(scripts/experiments/synonyms.py), with a small thesaurus in place of WordNet (which is not
a dependency): names, figures, the answer's words and function words stay; a rewording
never repeats a question there already or one of the score card's."""

from __future__ import annotations

import random

from scripts.experiments.synonyms import add_rewordings, reword

THESAURUS = {"warranty": ["guarantee", "warrant"], "cost": ["price"], "hinge": ["joint"],
             "handbook": ["manual"], "long": ["lengthy"]}


def lookup(word: str) -> list[str]:
    return THESAURUS.get(word, [])


def test_only_common_words_outside_the_answer_are_swapped():
    rng = random.Random(0)
    question = "What warranty does the Quiet Hinge have, and what does the hinge cost?"
    new = reword(question, "a lifetime warranty", rng, swaps=2, lookup=lookup)
    # "warranty" is the answer's word, "Hinge" a name: only the lower-case "hinge" and
    # "cost" can change, and both do.
    assert new == "What warranty does the Quiet Hinge have, and what does the joint price?"
    assert reword("Who is Dana Ruiz?", "Head of Logistics", rng, lookup=lookup) is None


def test_rewordings_follow_the_pairs_and_avoid_the_cards_questions():
    pairs = [("What does the handbook say about leave?", "27 days"),
             ("How long is the warranty?", "24 months"),
             ("Is the warranty long?", "yes"),
             ("Who founded it?", "Marguerite Olsson-Dray")]
    card = {"how lengthy is the guarantee"}  # normalised, as the builder passes them
    out = add_rewordings(pairs, 3, card, seed=0, lookup=lookup)
    assert out[:4] == pairs
    extra = out[4:]
    assert ("What does the manual say about leave?", "27 days") in extra
    warranty = [q for q, a in extra if a == "24 months"]
    assert warranty == ["How lengthy is the warrant?"]  # both words swapped, not the card's
    # Without the card, the same draws do ask the card's question.
    free = add_rewordings(pairs, 3, set(), seed=0, lookup=lookup)
    assert ("How lengthy is the guarantee?", "24 months") in free
    assert len({q for q, _ in out}) == len(out)  # nothing twice
    assert all(a != "Marguerite Olsson-Dray" for _, a in extra)  # nothing to swap there


def test_the_builder_practises_the_rewordings_and_is_restored(tmp_path, smol_tokenizer):
    from scripts.experiments.recall import load_corpus
    from scripts.experiments.synonyms import rewording
    from worker.dataset import build

    docs = load_corpus(tmp_path)
    plain = build.build_dataset(docs, smol_tokenizer, generated_qa=2, holdout_frac=0.0)
    with rewording(1, lookup=lambda w: ["manual"] if w == "handbook" else []):
        more = build.build_dataset(docs, smol_tokenizer, generated_qa=2, holdout_frac=0.0)
    again = build.build_dataset(docs, smol_tokenizer, generated_qa=2, holdout_frac=0.0)
    added = more.stats["n_train_generated_qa"] - plain.stats["n_train_generated_qa"]
    assert added > 0
    assert again.stats == plain.stats  # the builder is itself again
    decoded = [smol_tokenizer.decode(e["input_ids"]) for e in more.train_examples]
    assert sum("employee manual" in d for d in decoded) == added
