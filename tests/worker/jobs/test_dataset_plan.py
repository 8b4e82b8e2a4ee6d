"""The dataset plan (worker/jobs/dataset_plan.py): the training work of a job counted without
its model, step by step as the job's own recipe will run it."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from app.contract.dataset_plan import checked_plan
from app.contract.training import (
    LORA_LR,
    chosen,
    default_params,
    learning_rate_for,
    passes_for,
)
from scripts.experiments.recall import load_corpus
from worker.dataset.corpus import IGNORE_INDEX
from worker.jobs.dataset_plan import count_work
from worker.jobs.pipeline import job_dataset, job_settings, settled_job, train_tokens
from worker.training.recipe import FineTuneRecipe
from worker.training.replay import planned_lengths, planned_predicting


@pytest.fixture(scope="module")
def corpus_docs() -> list:
    with tempfile.TemporaryDirectory() as folder:
        return load_corpus(Path(folder))  # the fixture corpus as the worker extracts it


def _recipe_shapes(docs, tokenizer, params, extra: list[dict],
                   predicting: dict | None = None) -> tuple[int, dict]:
    """(steps, {(rows, width): steps}) of the recipe a job with `params` builds; fills
    `predicting` with {(rows, width): positions whose next token is a label}."""
    job = job_settings(docs, params, "", None, None)
    split = job_dataset(docs, tokenizer, job)
    recipe = FineTuneRecipe(object(), split.train_examples + extra, job.config, Path("/nowhere"))
    shapes: dict = {}
    for step in range(recipe.total_steps):
        batch = recipe.batch_for_step(step)
        shape = tuple(batch["input_ids"].shape)
        shapes[shape] = shapes.get(shape, 0) + 1
        if predicting is not None:
            labelled = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
            predicting[shape] = predicting.get(shape, 0) + labelled
    return recipe.total_steps, shapes


@pytest.mark.parametrize("epochs", [1, 4])
def test_the_plan_is_the_recipes_own_batches(corpus_docs, smol_tokenizer, epochs):
    n_words = sum(len(d.text.split()) for d in corpus_docs)
    params = chosen(default_params(n_words, 12, "lora"), {"epochs": epochs}) | {"replay": 0}
    plan = count_work(corpus_docs, smol_tokenizer, params, "key")
    predicting: dict = {}
    steps, shapes = _recipe_shapes(corpus_docs, smol_tokenizer, params, [], predicting)
    assert plan.steps == steps
    assert {(r, w): n for r, w, n in plan.shapes} == shapes
    # The positions where the output layer runs, shape by shape: far fewer than all of them
    # (the practice questions' prompts predict nothing).
    assert {(r, w): p for (r, w, _), p in zip(plan.shapes, plan.predicting, strict=True)
            } == predicting
    assert sum(plan.predicting) < 0.6 * sum(r * w * n for r, w, n in plan.shapes)
    assert plan.epochs == epochs and plan.replay == 0
    assert plan.examples == plan.chunks + plan.qa + plan.practice > plan.practice > 100
    assert checked_plan(plan.model_dump(), "key") == plan  # what the app reads back
    assert checked_plan(plan.model_dump(), "another key") is None


def test_replay_answers_are_counted_at_their_longest(corpus_docs, smol_tokenizer):
    params = default_params(862, 12, "lora")  # replay 16, as the Train button queues it
    plan = count_work(corpus_docs, smol_tokenizer, params, "key")
    assert plan.replay == 16
    longest = planned_lengths(smol_tokenizer, 16, 256)
    answers = planned_predicting(smol_tokenizer, 16, 256)
    replay = [{"input_ids": [0] * n, "labels": [IGNORE_INDEX] * (n - a) + [0] * a}
              for n, a in zip(longest, answers, strict=True)]
    predicting: dict = {}
    steps, shapes = _recipe_shapes(corpus_docs, smol_tokenizer, params, replay, predicting)
    assert plan.steps == steps and {(r, w): n for r, w, n in plan.shapes} == shapes
    assert dict(zip([(r, w) for r, w, _ in plan.shapes], plan.predicting, strict=True)
                ) == predicting
    assert 0 < min(answers) and max(answers) < min(longest)
    # Most steps are short practice questions: far fewer padded tokens than 256 per row.
    padded = sum(r * w * n for r, w, n in plan.shapes)
    assert padded < 0.6 * 4 * 256 * plan.steps


def test_the_office_corpus_of_the_estimate_benchmark_is_the_size_asked(tmp_path, smol_tokenizer):
    """tests/fixtures/office.py (`make bench-estimate`'s larger corpora): eight office files
    that read, about as many words as asked, the same for the same seed."""
    import hashlib

    from app.filetypes import kind_for_filename
    from tests.fixtures.office import write_office_corpus
    from worker.dataset.corpus import SourceDoc
    from worker.extract import extract

    paths = write_office_corpus(tmp_path / "a", 3_000)
    again = write_office_corpus(tmp_path / "b", 3_000)
    assert [p.read_bytes() for p in paths if p.suffix in (".md", ".csv", ".txt", ".html")] == [
        p.read_bytes() for p in again if p.suffix in (".md", ".csv", ".txt", ".html")]
    docs = []
    for path in paths:
        out = extract(path, kind_for_filename(path.name))
        docs.append(SourceDoc(path.name, hashlib.sha256(path.read_bytes()).hexdigest(),
                              out.text, list(out.qa_pairs)))
    words = sum(len(d.text.split()) + sum(len(q.split()) + len(a.split()) for q, a in d.qa_pairs)
                for d in docs)
    assert len(docs) == 8 and all(d.text or d.qa_pairs for d in docs)
    assert 2_700 < words < 3_600, words
    plan = count_work(docs, smol_tokenizer, default_params(words, 20, "lora"), "k")
    # Its files state the same facts with other values (a made-up corpus): the card asks
    # only the few whose question has one answer.
    assert plan.probes >= 5 and plan.practice > 150 and plan.qa > 10


def test_the_passes_are_set_from_the_tokens_the_documents_make(corpus_docs, smol_tokenizer):
    """The default's passes are guessed from the words until the dataset is built, then set
    from its tokens: office files written in lists and label lines make more practice per
    word than prose, so they are read fewer times than their words would say."""
    with tempfile.TemporaryDirectory() as folder:
        listed = load_corpus(Path(folder), "structured")  # tests/fixtures/structured_docs.py
    seen = {}
    for name, docs in (("prose", corpus_docs), ("lists", listed)):
        words = sum(len(d.text.split()) for d in docs)
        # A guess the dataset corrects (the job's row says 1 pass at a step of 0.009).
        params = default_params(words, 12, "lora") | {"epochs": 1, "learning_rate": 0.009}
        job = job_settings(docs, params, "", None, None)
        split = job_dataset(docs, smol_tokenizer, job)
        settled = settled_job(job, split).config
        tokens = train_tokens(split, settled.max_seq_len)
        assert settled.epochs == passes_for(tokens)
        assert settled.learning_rate == learning_rate_for("lora", settled.epochs)
        plan = count_work(docs, smol_tokenizer, params, "key")  # the Train panel's count
        assert plan.epochs == settled.epochs and plan.train_tokens == tokens
        assert plan.steps == settled.epochs * -(-plan.examples // settled.batch_size)
        seen[name] = (words, tokens, settled.epochs)
        # The row's params once the job set them: a resumed job finds its results again.
        row = params | {"epochs": settled.epochs, "learning_rate": settled.learning_rate}
        assert job_settings(docs, row, "", None, None).job_key == job.job_key
        assert job_settings(docs, chosen(row, {"epochs": settled.epochs}), "", None,
                            None).job_key != job.job_key
        # Chosen by hand, the passes stay; the step follows them.
        mine = settled_job(job_settings(docs, chosen(params, {"epochs": 4}), "", None, None),
                           split).config
        assert mine.epochs == 4 and mine.learning_rate == LORA_LR
    (prose_words, prose_tokens, prose_passes), (list_words, list_tokens, list_passes) = (
        seen["prose"], seen["lists"])
    assert list_words < 2 * prose_words and list_tokens > 2 * prose_tokens
    assert prose_passes == 3 and list_passes == 2
