"""The estimate next to the Train button, from the machine profile the worker writes."""

from __future__ import annotations

import json
import math

import pytest

from app.contract.dataset_plan import FORMAT as PLAN_FORMAT
from app.contract.dataset_plan import checked_plan
from app.contract.machine_profile import FORMAT
from app.db import session_scope
from app.services import planner
from app.services.projects import Corpus, corpus_of
from app.settings import settings

from .factories import htmx, make_document, make_project

# As worker/training/machine_profile.py writes it: LoRA fits in memory, full fine-tuning streams.
PROFILE = {
    "format": FORMAT,
    "measured_at": "2025-01-01T00:00:00+00:00",
    "base_model": "embedded",
    "budget_bytes": 2 << 30,
    "disk": {"read_gbps": 1.5, "write_gbps": 1.0, "o_direct": True, "bytes": 256 << 20},
    "cpu": {"matmul_flops": 2e11, "compute_efficiency": 0.5},
    "reference": {"batch_size": 4, "seq_len": 256},
    "methods": {
        "lora": {
            "fits_in_memory": True, "fits": True, "compute_s_per_step": 2.0,
            "io_s_per_step": 0.0, "min_budget_bytes": 1 << 30,
        },
        "full": {
            "fits_in_memory": False, "fits": True, "compute_s_per_step": 3.0,
            "io_s_per_step": 20.0, "min_budget_bytes": 1 << 30,
        },
    },
}  # fmt: skip


@pytest.fixture
def profile_file(env):
    path = settings.machine_profile_path
    path.write_text(json.dumps(PROFILE | {"base_model": settings.base_model}))
    yield path
    path.unlink(missing_ok=True)


def test_steps_and_time_follow_the_corpus():
    corpus = Corpus(n_words=10_000, n_qa=0)  # 2 epochs by default at this size
    est = planner.estimates_for(corpus, PROFILE, load=False)
    chunks = math.ceil(10_000 * 1.4 / 256)  # 55 chunks of 256 tokens
    practice = round(10_000 * planner.PRACTICE_QA_PER_WORD * 2)  # 2 questions per fact
    examples = chunks + practice + 16  # + the base model's answers to 16 everyday requests
    steps = 2 * math.ceil(examples / 4)
    assert est["lora"].steps == est["full"].steps == steps == 886
    # LoRA fits: the time is compute, at the reference batch (4 x 256 tokens).
    assert est["lora"].seconds == pytest.approx(steps * 2.0)
    assert est["lora"].text == "Fits in memory: about 30 min" and est["lora"].streams is False
    # Full streams: a step takes at least the disk time.
    assert est["full"].seconds == pytest.approx(steps * 20.0)
    assert est["full"].text == "Streams from the SSD: about 4 h 55 min" and est["full"].streams

    bigger = planner.estimates_for(Corpus(n_words=200_000), PROFILE, load=False)
    assert bigger["full"].seconds > 10 * est["full"].seconds
    # Without practice questions or replay, only the text chunks count.
    plain = {"method": "lora", "epochs": 2, "max_seq_len": 256}
    assert planner.estimate(corpus, plain, PROFILE).steps == 2 * math.ceil(chunks / 4)
    assert "h" in bigger["full"].text


def test_short_qa_batches_cost_less_compute_than_full_chunks():
    params = {"method": "lora", "epochs": 1, "max_seq_len": 256}
    text = planner.estimate(Corpus(n_words=365), params, PROFILE)  # 2 chunks: one step
    qa = planner.estimate(Corpus(n_qa=4), params, PROFILE)  # 4 pairs: one step
    assert text.steps == qa.steps == 1
    assert qa.seconds == pytest.approx(2.0 * 60 / 256)
    assert text.seconds == pytest.approx(2.0)


def test_practice_questions_pay_for_the_output_layer_only_at_their_answers():
    # The timed run's steps predict at every position; a counted plan says how many of its
    # positions predict a label: the output layer's FLOPs (head_flops) are charged only there.
    head = 1e8
    timed = json.loads(json.dumps(PROFILE)) | {"steps": {"lora": TIMED | {"head_flops": head}}}
    corpus = Corpus(n_words=10_000, n_qa=0)
    params = planner.default_params(10_000, 0, "lora")
    shapes = [(4, 60, 100), (4, 250, 10)]
    whole = planner.estimate(corpus, params, timed, _counted(shapes)).train_s
    # The short steps predict 40 of their 240 positions each (4,000 in all), the long ones all.
    est = planner.estimate(corpus, params, timed, _counted(shapes, predicting=[4_000, 10_000]))
    assert est.train_s == pytest.approx(whole - 1e-9 * head * 100 * (240 - 40))
    # A profile from before the output layer's share was timed: every position, as before.
    old = json.loads(json.dumps(PROFILE)) | {"steps": {"lora": TIMED}}
    assert planner.estimate(corpus, params, old, _counted(shapes, predicting=[4_000, 10_000])
                            ).train_s == pytest.approx(whole)


def test_a_base_model_larger_than_memory_adds_its_scoring_time():
    corpus = Corpus(n_words=10_000)
    plain = planner.estimates_for(corpus, PROFILE, load=False)
    big = json.loads(json.dumps(PROFILE))
    big["base"] = {"fp32_bytes": 30 << 30, "streams": True, "scoring_s": 3600.0}
    est = planner.estimates_for(corpus, big, load=False)
    # The downloads scale with the weights too: about 3,250 FLOP-equivalents per byte here.
    export = planner.EXPORT_WORK_PER_BYTE * (30 << 30) / 2e11
    for method in ("lora", "full"):
        assert est[method].phases["export"] == pytest.approx(export)
        assert est[method].seconds == pytest.approx(plain[method].seconds + 3600.0 + export)
        assert est[method].streams is True
        assert est[method].text.startswith("Base model larger than memory, streams from the SSD")
    big["base"]["streams"] = False  # measured as fitting: nothing added
    assert planner.estimates_for(corpus, big, load=False)["lora"].seconds == pytest.approx(
        plain["lora"].seconds + export)


def test_without_a_profile_or_a_fitting_budget():
    corpus = Corpus(n_words=1000)
    assert planner.estimates_for(corpus, None, load=False)["lora"].text == planner.ESTIMATING
    too_big = json.loads(json.dumps(PROFILE))
    too_big["methods"]["full"]["fits"] = False
    too_big["methods"]["full"]["min_budget_bytes"] = 5 << 30
    full = planner.estimates_for(corpus, too_big, load=False)["full"]
    assert full.seconds is None
    assert full.text == (
        "Too large for this machine: needs about 5.0 GB of memory, DocTune may use 2.0 GB."
    )


# A timed run of the real model (worker/training/step_timing.py): a step of rows x width
# tokens takes 1 + 1e-9 * rows * width * (3e8 + 1e6 * width) seconds, a checkpoint 2 s.
TIMED = {"measured": [[4, 64, 1.0], [4, 128, 1.0], [4, 256, 1.0]], "fixed_s": 1.0,
         "s_per_flop": 1e-9, "flops_per_token": [3e8, 1e6], "checkpoint_s": 2.0}


def _step_s(rows: int, width: int) -> float:
    return 1.0 + 1e-9 * rows * width * (3e8 + 1e6 * width)


def _counted(shapes: list[tuple[int, int, int]], key: str = "k",
             predicting: list[int] | None = None) -> object:
    steps = sum(n for *_, n in shapes)
    return checked_plan({"format": PLAN_FORMAT, "key": key, "examples": 4 * steps, "chunks": 1,
                         "qa": 0, "practice": 0, "replay": 0, "probes": 0, "questions": 0,
                         "heldout_chunks": 0, "heldout_qa": 0, "epochs": 1,
                         "steps": steps, "tokens": 1, "train_tokens": 1_000, "shapes": shapes,
                         "predicting": predicting or []})


def test_a_timed_run_and_a_counted_plan_give_the_time_step_by_step():
    timed = json.loads(json.dumps(PROFILE)) | {"steps": {"lora": TIMED}}
    corpus = Corpus(n_words=10_000, n_qa=0)
    params = planner.default_params(10_000, 0, "lora")
    shapes = [(4, 60, 100), (4, 250, 10), (2, 90, 1)]
    est = planner.estimate(corpus, params, timed, _counted(shapes))
    assert est.steps == 111 and est.counted
    # One epoch of 111 steps: checkpoints after steps 25, 50, 75, 100 and 111.
    assert est.train_s == pytest.approx(100 * _step_s(4, 60) + 10 * _step_s(4, 250)
                                        + _step_s(2, 90) + 5 * 2.0)
    # Without the plan: the rule of thumb's steps (886 in 2 epochs of 443), each at the fit's
    # time for 4 x 256, and 37 checkpoints (35 multiples of 25, and the end of epoch 1 and 2).
    guessed = planner.estimate(corpus, params, timed)
    assert guessed.steps == 886 and not guessed.counted and params["epochs"] == 2
    assert guessed.train_s == pytest.approx(886 * _step_s(4, 256) + 37 * 2.0)
    # Full fine-tuning was not timed: offload.plan's per-step figures, at least the disk time.
    full = planner.estimate(corpus, params | {"method": "full"}, timed, _counted(shapes))
    assert full.train_s == pytest.approx(111 * 20.0)


def test_the_plan_is_asked_for_once_the_documents_are_read_and_waited_for_a_while(env):
    from app.models import DocStatus

    with session_scope() as session:
        project = make_project(session)
        doc = make_document(session, project, word_count=500)
        corpus = planner.Corpus(n_words=500, usable=[doc])
        params = planner.default_params(500, 0, "lora")
        key = planner.dataset_key(corpus, params)
        pending = planner.Corpus(n_words=500, usable=[doc], n_pending=1)
        assert planner.plan_request(project, pending, params, 0.0) == (None, False)
        assert planner.plan_request(project, corpus, params, 0.0) == (key, False)
        assert planner.ask_for_plan(project, corpus, now=1000.0) is True  # asked: counting
        assert project.dataset_plan["requested"] == {"key": key, "at": 1000.0}
        assert planner.plan_request(project, corpus, params, 1000.0 + 60) == (None, True)
        # No answer after PLAN_WAIT_S: the rule of thumb, and no new request for a while.
        assert planner.plan_request(project, corpus, params, 1000.0 + 200) == (None, False)
        assert planner.plan_request(project, corpus, params, 1000.0 + 700) == (key, False)
        # Counted: nothing more to ask, and the estimate uses it.
        project.dataset_plan = {"plan": _counted([(4, 60, 7)], key).model_dump()}
        assert planner.plan_request(project, corpus, params, 2000.0) == (None, False)
        assert planner.dataset_plan(project, corpus, params).steps == 7
        # Another document (or an edit: another content hash): that plan is stale.
        other = make_document(session, project, word_count=100)
        more = planner.Corpus(n_words=600, usable=[doc, other])
        assert planner.dataset_plan(project, more, params) is None
        assert doc.status == DocStatus.extracted


def test_unreadable_or_old_profiles_count_as_missing(env):
    path = settings.machine_profile_path
    try:
        assert planner.load_profile() is None
        path.write_text("{not json")
        assert planner.load_profile() is None
        current = PROFILE | {"base_model": settings.base_model}
        path.write_text(json.dumps(current | {"format": 99}))
        assert planner.load_profile() is None
        path.write_text(json.dumps(current | {"base_model": "some/other-model"}))
        assert planner.load_profile() is None
        path.write_text(json.dumps(current))
        assert planner.load_profile() == current
    finally:
        path.unlink(missing_ok=True)


def _project_with_text() -> int:
    with session_scope() as session:
        project = make_project(session)
        make_document(session, project, word_count=10_000)
        return project.id


def test_train_panel_says_estimating_and_polls_until_the_profile_exists(client):
    project_id = _project_with_text()
    page = client.get(f"/projects/{project_id}").text
    assert (
        "Estimating this machine&#39;s speed…" in page or "Estimating this machine's speed…" in page
    )
    assert 'id="train-plan"' in page and 'hx-trigger="load delay:3s"' in page

    fragment = client.get(f"/projects/{project_id}", headers=htmx("train-plan")).text
    assert fragment.lstrip().startswith('<div id="train-plan"')
    assert "Add documents" not in fragment and "<html" not in fragment


def _panel(page: str) -> str:
    return page[page.index('id="train-plan"') : page.index("</dl>", page.index('id="train-plan"'))]


def test_train_panel_shows_both_methods_once_measured_then_counted(client, profile_file):
    from app.models import Project

    project_id = _project_with_text()
    page = client.get(f"/projects/{project_id}").text
    assert "Time to the score card on this machine" in page
    # A first guess while the worker counts the dataset plan (asked for by this view).
    assert "Fits in memory: about 30 min" in page
    assert "Streams from the SSD: about 4 h 55 min" in page
    panel = _panel(page)
    assert "counting the work in your documents" in panel and "hx-trigger" in panel
    assert 'id="train-guess"' in page  # the passes shown are the words' guess, and it says so
    assert '<div class="chosen"><dt>LoRA</dt>' in panel
    with session_scope() as session:  # what the worker writes (worker/jobs/dataset_plan.py)
        project = session.get(Project, project_id)
        corpus = corpus_of(project)
        key = planner.dataset_key(corpus, planner.default_params(10_000, 0, "lora"))
        assert project.dataset_plan["requested"]["key"] == key
        project.dataset_plan = {**project.dataset_plan,
                                "plan": _counted([(4, 64, 400)], key).model_dump()}
    panel = _panel(client.get(f"/projects/{project_id}", headers=htmx("train-plan")).text)
    assert "hx-trigger" not in panel and "counting" not in panel  # counted: no more polling
    # The passes and the step the job will set from its dataset's tokens (1,000 counted: three
    # at 1.5e-3), where 10,000 words were guessed to need two at 2e-3.
    assert "Passes over your documents</dt><dd>2</dd>" in page and "<dd>0.002</dd>" in page
    page = client.get(f"/projects/{project_id}").text
    assert "Passes over your documents</dt><dd>3</dd>" in page and "<dd>0.0015</dd>" in page
    assert 'id="train-guess"' not in page  # counted: what the job will set
    assert 'placeholder="3 (default)"' in page  # the Advanced form's epochs
    # 400 steps of 4 x 64 tokens: a quarter of the reference step's 2 s each (LoRA); full
    # fine-tuning streams, at least the 20 s disk time per step.
    assert "Fits in memory: about 3 min" in panel
    assert "Streams from the SSD: about 2 h 13 min" in panel


def test_no_estimate_while_training_cannot_start(client, profile_file):
    with session_scope() as session:
        project_id = make_project(session).id
    page = client.get(f"/projects/{project_id}").text
    assert 'id="train-plan"' not in page


# Learning from finished jobs ----------------------------------------------------------------


def test_finished_jobs_correct_the_estimate_by_their_median_and_add_their_other_phases():
    corpus = Corpus(n_words=10_000, n_qa=0)
    plain = planner.estimates_for(corpus, PROFILE, load=False)["lora"]
    assert plain.train_s == pytest.approx(886 * 2.0) and plain.based_on == 0
    history = [  # newest first: training took 0.5x, 2x and 0.6x what was estimated
        planner.Finished("lora", 1000.0, 500.0, 70.0),
        planner.Finished("full", 1000.0, 9000.0, 500.0),  # another method: not used
        planner.Finished("lora", 1000.0, 2000.0, 50.0),
        planner.Finished("lora", 1000.0, 600.0, 90.0),
        planner.Finished("lora", 1000.0, 5000.0, 999.0),  # a fourth: older than the last 3
    ]
    est = planner.estimates_for(corpus, PROFILE, load=False, history=history)["lora"]
    assert est.seconds == pytest.approx(886 * 2.0 * 0.6 + (70 + 50 + 90) / 3)
    assert est.text == "Fits in memory: about 19 min (based on your last 3 jobs)"
    assert est.based_on == 3
    one = planner.estimates_for(corpus, PROFILE, load=False, history=history[:1])["lora"]
    assert one.seconds == pytest.approx(886 * 2.0 * 0.5 + 70)
    assert one.text.endswith("(based on your last job)")


def test_a_queued_job_keeps_the_estimate_and_a_finished_one_teaches_the_next(
        client, env, profile_file):
    from app.models import Job, JobState

    with session_scope() as session:
        project = make_project(session, "Calibrated")
        make_document(session, project, word_count=2_000)
        project_id = project.id
    r = client.post(f"/projects/{project_id}/jobs", data={"method": "lora"},
                    follow_redirects=False)
    job_id = int(r.headers["location"].rsplit("/", 1)[1])
    with session_scope() as session:
        job = session.get(Job, job_id)
        assert job.estimate["train_s"] > 0 and job.estimate["steps"] > 0
        estimated = job.estimate["train_s"]
        before = planner.estimates_for(Corpus(n_words=2_000, n_qa=0), PROFILE, load=False)
        # What follows training, for the ETA before any job has finished on this machine.
        phases = before["lora"].phases
        assert job.estimate["after_s"] == pytest.approx(phases["after"] + phases["export"],
                                                        abs=1e-3)
        # The job ran: its training took twice the estimate, scoring and exports 120 s.
        job.state = JobState.done
        job.metrics = {"phase_s": {"before": 50.0, "train": 2 * estimated, "after": 50.0,
                                   "export": 20.0}}
    page = client.get(f"/projects/{project_id}").text
    # The base model's scores are kept from that job (same documents and settings): the
    # next one only scores the tuned model (50 s) and exports (20 s) after twice the training.
    expected = planner.human_duration(2 * before["lora"].train_s + 50.0 + 20.0)
    assert f"Fits in memory: {expected} (based on your last job)" in page
    job_page = client.get(f"/jobs/{job_id}").text
    assert "Took scoring the base model less than a minute, training " in job_page
    assert "scoring the tuned model less than a minute, downloads less than a minute." in job_page


def test_time_left_adds_what_follows_training_as_the_last_jobs_took_it(client, env):
    from app.models import Job, JobState

    from .factories import make_job

    with session_scope() as session:
        project = make_project(session, "ETA")
        for after, export in ((300.0, 60.0), (500.0, 100.0)):  # two finished jobs
            make_job(session, project, JobState.done, estimate={"train_s": 100.0},
                     metrics={"phase_s": {"before": 1.0, "train": 100.0, "after": after,
                                          "export": export}})
        running = make_job(session, project, JobState.running)  # its own ETA: 200 s
        job_id = running.id
        history = planner.history(session)
        assert planner.time_left(session.get(Job, job_id), history) == pytest.approx(
            200.0 + (360.0 + 600.0) / 2)
    page = client.get(f"/jobs/{job_id}").text
    assert "about 11 min" in page and "(training about 3 min" not in page
    assert "(training 3 min, then scoring and downloads)" in page


def test_time_left_before_any_job_finished_adds_what_the_estimate_put_after_training(env):
    from app.models import Job, JobState

    from .factories import make_job

    with session_scope() as session:
        project = make_project(session, "First job")
        running = make_job(session, project, JobState.running,
                           estimate={"train_s": 100.0, "after_s": 90.0})  # its own ETA: 200 s
        older = make_job(session, project, JobState.running, estimate={"train_s": 100.0})
        assert planner.history(session) == []
        assert planner.time_left(session.get(Job, running.id), []) == pytest.approx(290.0)
        # A job queued before the estimate kept its later phases: its own ETA alone.
        assert planner.time_left(session.get(Job, older.id), []) == pytest.approx(200.0)


# The whole wait: scoring before and after from the profile's timed generation ------------

SCORING = {"decode_s": 0.05, "forward_s": 0.5, "general_forwards": 3}


def test_scoring_phases_follow_the_plan_and_kept_scores_skip_the_base_models(env):
    from app.models import JobState

    from .factories import make_job

    timed = json.loads(json.dumps(PROFILE)) | {"steps": {"lora": TIMED}, "scoring": SCORING}
    with session_scope() as session:
        project = make_project(session, "Phases")
        doc = make_document(session, project, word_count=500)
        corpus = planner.Corpus(n_words=500, usable=[doc])
        params = planner.default_params(500, 0, "lora")
        counted = _counted([(4, 64, 10)]).model_copy(
            update={"probes": 40, "questions": 33, "heldout_chunks": 2, "heldout_qa": 9,
                    "replay": 16})
        est = planner.estimate(corpus, params, timed, counted)
        # 5 batches of completions (24 tokens), 5 of questions (48), 2 of held-out pairs (24),
        # 1 forward of held-out text and 3 of the forgetting check; before training also the
        # replay answers: 2 batches of 96 tokens.
        side = 0.05 * (24 * 5 + 48 * 5 + 24 * 2) + 0.5 * (1 + 3)
        assert est.phases == pytest.approx({"before": side + 0.05 * 96 * 2, "train": est.train_s,
                                            "after": side, "export": 0.0})
        assert est.seconds == pytest.approx(sum(est.phases.values()))
        assert est.breakdown().startswith("scoring the base model less than a minute, training ")
        assert not planner.before_is_cached(session, corpus, params)
        # A finished job from the base model on the same documents and settings: its "before"
        # scores are kept, so only the replay answers are made before training.
        make_job(session, project, JobState.done, params=dict(params),
                 sources=[{"id": doc.id, "name": doc.original_name, "sha256": doc.sha256}])
        assert planner.before_is_cached(session, corpus, params)
        assert not planner.before_is_cached(session, corpus, params | {"max_seq_len": 512})
        kept = planner.estimates_for(corpus, timed, load=False, project=project)["lora"]
        assert kept.before_cached and kept.phases["before"] == pytest.approx(0.05 * 96 * 2)
