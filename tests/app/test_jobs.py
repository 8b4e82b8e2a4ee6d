"""The job page in every state, its live fragment, cancelling, and downloads."""

from __future__ import annotations

import re

import pytest

from app.db import session_scope
from app.models import Job, JobState
from app.settings import settings

from .factories import htmx, make_job, make_project, sample_scores, write_artifact

POLL = 'hx-trigger="load delay:1s"'


def _job(state: str, **fields) -> int:
    with session_scope() as session:
        project = make_project(session, "Support FAQ")
        return make_job(session, project, state, **fields).id


def _get(job_id: int) -> Job:
    with session_scope() as session:
        return session.get(Job, job_id)


EXPECTED = {
    JobState.queued: ["waiting to start", "Waiting for earlier jobs to finish.", "Cancel training"],
    JobState.running: [
        "training",
        "Training on your documents",
        "Step 40 of 120",
        "33%",
        "1,834 tokens/s",
        "about 3 min",
        "<polyline",
        "Cancel training",
    ],
    JobState.evaluating: ["measuring", "Step 40 of 120", "<polyline"],
    JobState.done: [
        "done",
        "Did it get better?",
        "10%",
        "60%",
        "1 of 10 facts before",
        "6 of 10 after",
        "41.7",
        "12.3",
        "lower is better",
        "higher is better",
        "Your questions",
        "18%",
        "62%",
        "Answer contained word for word: 0% → 40%",
        "fact checks, before and after",
    ],
    JobState.failed: ["failed", "Training stopped.", "ran out of memory", "train again"],
    JobState.cancelled: ["cancelled", "This job was cancelled."],
}


@pytest.mark.parametrize("state", list(JobState))
def test_job_page_renders_every_state(client, state):
    job_id = _job(state)
    page = client.get(f"/jobs/{job_id}")
    assert page.status_code == 200
    assert "<html" in page.text and "Training job #" in page.text and "Settings used" in page.text
    for text in EXPECTED[state]:
        assert text in page.text, text
    assert (POLL in page.text) == (not state.finished)  # polling stops once the job ends
    assert ("Cancel training" in page.text) == (not state.finished)
    assert "Traceback" not in page.text


@pytest.mark.parametrize(
    ("modules", "shown"),
    [("mlp", "the MLP only"), ("all", "attention and MLP (every projection)"), (None, None)],
)
def test_the_settings_say_which_layers_lora_adapted(client, modules, shown):
    params = {"method": "lora", "epochs": 4, "lora_rank": 16}
    job_id = _job(JobState.done, params=params | ({"lora_modules": modules} if modules else {}))
    page = client.get(f"/jobs/{job_id}").text
    assert ("LoRA adapts" in page) == (shown is not None)  # an older job did not say
    if shown:
        assert f"<dt>LoRA adapts</dt><dd>{shown}</dd>" in page


@pytest.mark.parametrize("alpha", [5.0, 0.0, None])
def test_the_settings_say_when_a_job_learned_with_noise(client, alpha):
    params = {"method": "lora", "epochs": 3, "lora_rank": 16}
    job_id = _job(JobState.done, params=params | ({} if alpha is None else {"neftune_alpha": alpha}))
    page = client.get(f"/jobs/{job_id}").text
    assert ("<dt>Noise while learning</dt><dd>NEFTune, strength 5</dd>" in page) == bool(alpha)
    assert ("Noise while learning" in page) == bool(alpha)  # none, or a job from before it


@pytest.mark.parametrize(
    ("state", "auto", "guessed"),
    [(JobState.queued, ["epochs", "learning_rate"], True),
     (JobState.queued, [], False),  # chosen in Advanced: the job keeps them
     (JobState.running, ["epochs", "learning_rate"], False)],  # set when it started
)
def test_a_queued_job_says_its_passes_are_set_when_it_starts(client, state, auto, guessed):
    params = {"method": "lora", "epochs": 4, "learning_rate": 1e-3, "lora_rank": 16,
              "auto": auto}
    page = client.get(f"/jobs/{_job(state, params=params)}").text
    assert "<dt>Passes over your documents</dt><dd>4" in page
    assert ("set from your documents when training starts" in page) == guessed
    assert ("(follows the passes)" in page) == guessed


def test_live_fragment_for_htmx_and_the_full_page_otherwise(client):
    job_id = _job(JobState.running)
    fragment = client.get(f"/jobs/{job_id}", headers=htmx("job-live"))
    assert fragment.status_code == 200
    assert fragment.text.lstrip().startswith('<section id="job-live"')
    assert "<html" not in fragment.text and "Settings used" not in fragment.text
    assert POLL in fragment.text and "Step 40 of 120" in fragment.text
    assert "HX-Request" in fragment.headers["vary"]
    full = client.get(f"/jobs/{job_id}")
    assert "<html" in full.text and 'id="job-live"' in full.text


def test_the_fragment_follows_the_job_to_its_end(client):
    job_id = _job(JobState.running)
    assert POLL in client.get(f"/jobs/{job_id}", headers=htmx("job-live")).text
    with session_scope() as session:
        job = session.get(Job, job_id)
        job.state = JobState.done
        job.scores = sample_scores()
    fragment = client.get(f"/jobs/{job_id}", headers=htmx("job-live")).text
    assert POLL not in fragment
    assert "Did it get better?" in fragment


def test_loss_curve_is_an_inline_svg_polyline(client):
    history = [[s, 4.0 - s / 50] for s in range(0, 101, 10)]
    job_id = _job(JobState.running, loss_history=history, step=100, total_steps=200)
    page = client.get(f"/jobs/{job_id}").text
    points = re.search(r'<polyline class="loss-line" points="([^"]+)"', page).group(1).split()
    assert len(points) == len(history)
    ys = [float(p.split(",")[1]) for p in points]
    assert ys == sorted(ys)  # a falling loss is drawn going down (SVG y grows downwards)
    assert "4.000 at the start, 2.000 now" in page


def test_cancel_sets_the_flag_and_shows_cancelling(client):
    job_id = _job(JobState.running)
    r = client.post(f"/jobs/{job_id}/cancel", headers=htmx("job-live"))
    assert r.status_code == 200
    assert _get(job_id).cancel_requested is True
    assert r.text.lstrip().startswith('<section id="job-live"')
    assert "cancelling…" in r.text and "Cancelling…" in r.text
    assert "Cancel training" not in r.text
    assert POLL in r.text  # it keeps watching until the worker has stopped


def test_cancel_without_javascript_redirects_back(client):
    job_id = _job(JobState.queued)
    r = client.post(f"/jobs/{job_id}/cancel", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == f"/jobs/{job_id}"
    assert _get(job_id).cancel_requested is True
    assert "as soon as its turn comes" in client.get(f"/jobs/{job_id}").text


def test_cancelling_a_finished_job_changes_nothing(client):
    job_id = _job(JobState.done)
    assert client.post(f"/jobs/{job_id}/cancel", follow_redirects=False).status_code == 303
    job = _get(job_id)
    assert job.cancel_requested is False and job.state == JobState.done


def test_downloads_stream_the_zip_with_a_readable_name(client, env):
    job_id = _job(JobState.done)
    adapter = write_artifact(env.data_dir, job_id, "adapter", size=3 * 1024 * 1024)
    with session_scope() as session:
        session.get(Job, job_id).artifacts = {"adapter": str(adapter)}
    page = client.get(f"/jobs/{job_id}").text
    assert f'href="/jobs/{job_id}/download/adapter"' in page
    assert "LoRA adapter (.zip)" in page
    assert "Merged model (.zip)" not in page  # no merged file for this job: no link

    with client.stream("GET", f"/jobs/{job_id}/download/adapter") as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "application/zip"
        assert f'filename="Support-FAQ-job{job_id}-adapter.zip"' in r.headers["content-disposition"]
        assert int(r.headers["content-length"]) == adapter.stat().st_size
        body = b"".join(r.iter_bytes())
    assert body == adapter.read_bytes()


@pytest.mark.parametrize(
    ("state", "artifacts", "kind", "message"),
    [
        (
            JobState.running,
            {},
            "adapter",
            "Downloads are ready once the training job has finished.",
        ),
        (JobState.done, {}, "merged", "This job has no merged model to download."),
        (
            JobState.done,
            {"merged": "/nonexistent/merged.zip"},
            "merged",
            "missing from the data folder",
        ),
        (JobState.done, {"adapter": "/etc/passwd"}, "adapter", "missing from the data folder"),
        (JobState.done, {}, "secrets", "There is no such download."),
    ],
)
def test_missing_downloads_are_a_clear_404(client, state, artifacts, kind, message):
    job_id = _job(state, artifacts=artifacts)
    r = client.get(f"/jobs/{job_id}/download/{kind}")
    assert r.status_code == 404
    assert message in r.text
    assert r.headers["content-type"].startswith("text/html")


def test_relative_artifact_paths_are_inside_the_data_dir(client, env):
    job_id = _job(JobState.done)
    merged = write_artifact(env.data_dir, job_id, "merged", size=1024)
    with session_scope() as session:
        session.get(Job, job_id).artifacts = {"merged": str(merged.relative_to(settings.data_dir))}
    assert client.get(f"/jobs/{job_id}/download/merged").content == merged.read_bytes()


def test_unknown_job(client):
    r = client.get("/jobs/31337")
    assert r.status_code == 404
    assert "There is no training job number 31337" in r.text
    r = client.get("/jobs/31337", headers=htmx("job-live"))
    assert r.status_code == 404
    assert "<html" not in r.text and "There is no training job number 31337" in r.text
    assert client.post("/jobs/31337/cancel").status_code == 404


def test_failed_job_shows_words_not_a_stack_trace_and_the_project_stays_usable(client):
    job_id = _job(
        JobState.failed, error="The training data could not be read. Please re-upload manual.pdf."
    )
    page = client.get(f"/jobs/{job_id}").text
    assert "Please re-upload manual.pdf." in page
    project_id = _get(job_id).project_id
    project_page = client.get(f"/projects/{project_id}")
    assert project_page.status_code == 200 and "failed" in project_page.text


def test_project_page_lists_jobs_with_a_score_summary(client):
    with session_scope() as session:
        project = make_project(session)
        done = make_job(session, project, JobState.done)
        running = make_job(session, project, JobState.running)
        project_id, done_id, running_id = project.id, done.id, running.id
    page = client.get(f"/projects/{project_id}").text
    assert f'href="/jobs/{done_id}"' in page and f'href="/jobs/{running_id}"' in page
    assert "Recall 10% → 60%" in page
    assert page.index(f"Training job #{running_id}") < page.index(
        f"Training job #{done_id}"
    )  # newest first
    jobs = client.get(f"/projects/{project_id}", headers=htmx("jobs"))
    assert jobs.text.lstrip().startswith('<div id="jobs"')
    assert 'hx-trigger="load delay:2s"' in jobs.text
