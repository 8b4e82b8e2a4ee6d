"""The Train button: when it is usable, what pressing it creates, and what it sends."""

from __future__ import annotations

import base64
import json
import re

import pytest
from sqlalchemy import select

from app.contract.tasks import TRAIN_TASK
from app.contract.training import default_params
from app.db import session_scope
from app.models import DocStatus, Job, JobState, Project
from app.services import jobs as jobs_service
from app.services.errors import InvalidInput

from .factories import make_document, make_project


def _train_button(html: str) -> str:
    return re.search(r"<button[^>]*>Train</button>", html).group(0)


def _jobs() -> list[Job]:
    with session_scope() as session:
        return list(session.scalars(select(Job).order_by(Job.id)))


def _train_messages(env) -> list[dict]:
    """The messages waiting in Celery's "train" queue (kombu's Redis list), decoded."""
    return [json.loads(raw) for raw in env.redis.lrange("train", 0, -1)]


@pytest.mark.parametrize(
    ("statuses", "reason"),
    [
        ([], "Add documents first"),
        ([DocStatus.pending, DocStatus.extracted], "1 document is still being read"),
        ([DocStatus.failed, DocStatus.duplicate], "None of the documents gave usable text"),
    ],
)
def test_train_is_disabled_with_the_reason(client, env, statuses, reason):
    with session_scope() as session:
        project = make_project(session)
        for i, status in enumerate(statuses):
            make_document(
                session,
                project,
                f"doc{i}.txt",
                status,
                error="Unreadable." if status == "failed" else None,
            )
        project_id = project.id
    page = client.get(f"/projects/{project_id}").text
    assert "disabled" in _train_button(page)
    assert reason in page
    r = client.post(f"/projects/{project_id}/jobs", data={}, follow_redirects=False)
    assert r.status_code == 422
    assert reason in r.text
    assert _jobs() == []
    assert env.queue_length("train") == 0


def test_train_shows_the_defaults_for_the_corpus(client, env):
    with session_scope() as session:
        project = make_project(session)
        make_document(session, project, "a.txt", word_count=3000)
        make_document(session, project, "faq.csv", word_count=0, qa_count=100)
        project_id = project.id
    page = client.get(f"/projects/{project_id}").text
    assert "disabled" not in _train_button(page)
    expected = default_params(3000, 100, "lora")  # 6,000 "words": 2 epochs
    assert expected["epochs"] == 2
    assert re.search(rf"Passes over your documents</dt><dd>{expected['epochs']}</dd>", page)
    assert expected["learning_rate"] == 0.002 and "<dd>0.002</dd>" in page  # 2 passes' step
    assert "<dd>16</dd>" in page and "<dd>256 tokens</dd>" in page
    assert "<dd>2 per fact in your documents</dd>" in page  # the practice questions
    assert "<dd>16 (so the model keeps its general English)</dd>" in page  # the replay
    assert "<dt>Noise while learning</dt><dd>on (NEFTune, strength 5)" in page
    assert "<dd>none: your documents are short, so all of them are learned</dd>" in page
    assert "3,000 words and 100 question-answer pairs" in page
    assert '<details class="advanced"' in page
    assert 'id="train-guess"' in page  # nothing counted yet: the passes are the words' guess


def test_an_empty_project_guesses_nothing(client, env):
    with session_scope() as session:
        project_id = make_project(session).id
    assert 'id="train-guess"' not in client.get(f"/projects/{project_id}").text


def test_pressing_train_creates_a_queued_job_and_sends_one_message_after_commit(client, env):
    with session_scope() as session:
        project = make_project(session)
        good = make_document(session, project, "manual.pdf", word_count=1200)
        make_document(session, project, "broken.pdf", DocStatus.failed, error="Damaged file.")
        make_document(session, project, "copy.pdf", DocStatus.duplicate)
        project_id, good_id, good_sha = project.id, good.id, good.sha256

    r = client.post(f"/projects/{project_id}/jobs", data={"method": "lora"}, follow_redirects=False)
    assert r.status_code == 303
    [job] = _jobs()
    assert r.headers["location"] == f"/jobs/{job.id}"
    assert job.state == JobState.queued
    assert job.method == "lora"
    assert job.params == default_params(1200, 0, "lora")
    # "new": the first job starts from the base model, so every document is new to it.
    assert job.sources == [{"id": good_id, "name": "manual.pdf", "sha256": good_sha, "new": True}]

    messages = _train_messages(env)
    assert len(messages) == 1
    assert messages[0]["headers"]["task"] == TRAIN_TASK
    assert json.loads(base64.b64decode(messages[0]["body"]))[0] == [job.id]
    assert env.queue_length("ingest") == 0

    page = client.get(r.headers["location"])  # the job page is there at once (committed)
    assert page.status_code == 200 and "waiting to start" in page.text


def test_several_jobs_may_be_queued(client, env):
    with session_scope() as session:
        project = make_project(session)
        make_document(session, project, "a.txt")
        project_id = project.id
    for _ in range(3):
        assert (
            client.post(f"/projects/{project_id}/jobs", follow_redirects=False).status_code == 303
        )
    assert [j.state for j in _jobs()] == ["queued"] * 3
    assert env.queue_length("train") == 3
    page = client.get(f"/projects/{project_id}").text
    assert "3 jobs already waiting or running" in page
    assert page.count("waiting to start") == 3
    assert 'hx-trigger="load delay:2s"' in page  # the job list refreshes itself meanwhile


def test_advanced_settings_override_the_defaults(client, env):
    with session_scope() as session:
        project = make_project(session)
        make_document(session, project, "a.txt", word_count=500)
        project_id = project.id
    form = {
        "method": "full",
        "epochs": "3",
        "learning_rate": "0,00005",
        "lora_rank": "",
        "max_seq_len": "512",
    }
    r = client.post(f"/projects/{project_id}/jobs", data=form, follow_redirects=False)
    assert r.status_code == 303
    [job] = _jobs()
    assert job.method == "full"
    assert job.params == {
        **default_params(500, 0, "full"),
        "epochs": 3,
        "learning_rate": 5e-5,
        "max_seq_len": 512,
        "auto": [],  # both chosen: the job does not set them from its dataset
    }


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("epochs", "0", "Epochs must be a whole number from 1 to 50; 0 is out of range."),
        ("epochs", "2.5", "Epochs must be a whole number from 1 to 50, without decimals."),
        (
            "learning_rate",
            "fast",
            "Learning rate must be a number from 0.000001 to 0.01; “fast” is not.",
        ),
        (
            "learning_rate",
            "0.5",
            "Learning rate must be a number from 0.000001 to 0.01; 0.5 is out of range.",
        ),
        ("learning_rate", "nan", "Learning rate must be a number from 0.000001 to 0.01."),
        (
            "lora_rank",
            "1000",
            "LoRA rank must be a whole number from 1 to 256; 1000 is out of range.",
        ),
        (
            "max_seq_len",
            "16",
            "Max sequence length must be a whole number from 32 to 4096; 16 is out of range.",
        ),
        ("method", "magic", "Please choose LoRA or full fine-tuning."),
    ],
)
def test_advanced_settings_are_validated_with_clear_messages(client, env, field, value, message):
    with session_scope() as session:
        project = make_project(session)
        make_document(session, project, "a.txt")
        project_id = project.id
    r = client.post(f"/projects/{project_id}/jobs", data={field: value})
    assert r.status_code == 422
    assert message in r.text
    assert '<details class="advanced" open>' in r.text  # the section opens on the error
    if field != "method":
        assert f'id="f-{field}"' in r.text.split('aria-invalid="true"')[0][-400:]
    assert _jobs() == []
    assert env.queue_length("train") == 0


def test_a_rolled_back_job_sends_nothing(env):
    with session_scope() as session:
        project = make_project(session)
        make_document(session, project, "a.txt")
        project_id = project.id
    with pytest.raises(RuntimeError), session_scope() as session:
        jobs_service.create_job(session, session.get(Project, project_id), {})
        raise RuntimeError("the request failed after the job was created")
    assert _jobs() == []
    assert env.queue_length("train") == 0

    with session_scope() as session:  # and the same call, committed, sends exactly one
        jobs_service.create_job(session, session.get(Project, project_id), {})
        assert env.queue_length("train") == 0  # not before the commit
    assert env.queue_length("train") == 1


def test_create_job_refuses_while_documents_are_pending(env):
    with session_scope() as session:
        project = make_project(session)
        make_document(session, project, "a.txt")
        make_document(session, project, "b.txt", DocStatus.pending)
        with pytest.raises(InvalidInput, match="still being read"):
            jobs_service.create_job(session, project, {})


def test_the_passes_fall_as_the_datasets_tokens_grow_so_training_stays_near_ten_minutes():
    from app.contract.training import MOST_PASSES, PASS_TOKENS, passes_for

    assert MOST_PASSES == 3
    assert passes_for(13_671) == 3  # the fixture corpus (Northwind): four read no better
    assert passes_for(PASS_TOKENS // 4) == 3
    assert passes_for(29_497) == 3  # Northwind's and Cogwell's files in one project
    assert passes_for(PASS_TOKENS // 3) == 3
    assert passes_for(PASS_TOKENS // 3 + 1) == 2
    assert passes_for(32_902) == 2  # Brindle Oakes (tests/fixtures/structured_docs.py)
    assert passes_for(36_365) == 2  # Saltgrove (tests/fixtures/fullsize_docs.py)
    assert passes_for(10 * PASS_TOKENS) == 2  # never fewer than two
    assert passes_for(0) == 3


def test_before_the_dataset_is_built_the_passes_are_guessed_from_the_words():
    assert default_params(862, 12, "lora")["epochs"] == 3  # the fixture corpus
    assert default_params(3_111, 12, "lora")["epochs"] == 2  # tests/fixtures/fullsize_docs.py
    assert default_params(50_000, 0, "full")["epochs"] == 2
    # ... and left to the job, which sets them from its dataset's tokens
    assert set(default_params(862, 12, "lora")["auto"]) == {"epochs", "learning_rate"}


def test_fewer_passes_take_a_larger_lora_step():
    from app.contract.training import (
        FULL_LR,
        LORA_LR,
        LORA_LR_THREE_PASSES,
        LORA_LR_TWO_PASSES,
        learning_rate_for,
    )

    assert LORA_LR_TWO_PASSES > LORA_LR_THREE_PASSES > LORA_LR
    assert learning_rate_for("lora", 4) == learning_rate_for("lora", 6) == LORA_LR
    assert learning_rate_for("lora", 3) == LORA_LR_THREE_PASSES
    assert learning_rate_for("lora", 2) == learning_rate_for("lora", 1) == LORA_LR_TWO_PASSES
    assert learning_rate_for("full", 2) == FULL_LR == 2e-5  # full: one step
    assert default_params(862, 12, "lora")["learning_rate"] == LORA_LR_THREE_PASSES
    assert default_params(3_111, 12, "lora")["learning_rate"] == LORA_LR_TWO_PASSES
    assert default_params(3_111, 12, "full")["learning_rate"] == FULL_LR


def test_the_dataset_settles_only_what_the_user_left_to_it():
    from app.contract.training import (
        LORA_LR,
        LORA_LR_TWO_PASSES,
        PASS_TOKENS,
        chosen,
        settle,
    )

    defaults = default_params(862, 12, "lora")  # guessed: 3 passes at LoRA's 1.5e-3
    assert settle(defaults, PASS_TOKENS) == {"epochs": 2, "learning_rate": LORA_LR_TWO_PASSES}
    assert settle(defaults, 1_000) == {"epochs": 3, "learning_rate": 1.5e-3}
    four = chosen(defaults, {"epochs": 4})  # more passes than the default's: the small step
    assert settle(four, 1_000) == {"learning_rate": LORA_LR}
    assert settle(defaults, PASS_TOKENS // 3) == {"epochs": 3, "learning_rate": 1.5e-3}
    # Passes chosen by hand stay; the step follows them unless it was chosen too.
    mine = chosen(defaults, {"epochs": 2})
    assert mine["auto"] == ["learning_rate"] and mine["learning_rate"] == LORA_LR_TWO_PASSES
    assert settle(mine, 1_000) == {"learning_rate": LORA_LR_TWO_PASSES}
    three = chosen(defaults, {"epochs": 3})
    assert three["learning_rate"] == 1.5e-3 and settle(three, PASS_TOKENS) == {
        "learning_rate": 1.5e-3}
    both = chosen(defaults, {"epochs": 3, "learning_rate": 5e-4})
    assert both["auto"] == [] and settle(both, PASS_TOKENS) == {}
    assert both["epochs"] == 3 and both["learning_rate"] == 5e-4
    step = chosen(defaults, {"learning_rate": 5e-4})  # the passes still the dataset's
    assert settle(step, PASS_TOKENS) == {"epochs": 2}
    assert chosen(defaults, {}) == defaults
    full = default_params(862, 12, "full")
    assert settle(full, PASS_TOKENS) == {"epochs": 2, "learning_rate": 2e-5}
    assert settle({"method": "lora", "epochs": 3}, 1_000) == {}  # a job from before: as set


def test_short_document_sets_are_trained_on_whole():
    from app.contract.training import HOLDOUT_FRAC, HOLDOUT_FROM_WORDS

    assert default_params(862, 12, "lora")["holdout_frac"] == 0.0  # the fixture corpus
    assert default_params(HOLDOUT_FROM_WORDS - 1, 0, "full")["holdout_frac"] == 0.0
    assert default_params(HOLDOUT_FROM_WORDS, 0, "lora")["holdout_frac"] == HOLDOUT_FRAC > 0
