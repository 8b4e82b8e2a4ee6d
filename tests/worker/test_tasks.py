"""The worker as it really runs: a Celery worker process fed through Redis, the job row
in a migrated SQLite file, a tiny random model as base. The web side is played by the
same services the routes call."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from app.db import session_scope
from app.models import DocStatus, Document, Job, JobState
from app.services.documents import register_uploads
from app.services.jobs import create_job, request_cancel
from app.services.projects import create_project
from app.services.uploads import receive_local_file
from app.settings import settings
from tests.conftest import WorkerProcess, wait_for
from tests.fixtures import docs as fx

pytestmark = pytest.mark.usefixtures("celery_worker")

FACTS = [
    "The Northwind warranty lasts 36 months from the date of delivery.",
    "Part NW-4471 ships from the Lyon warehouse within 2 working days.",
    "Support tickets marked urgent are answered within 4 hours by Dana Whitfield.",
    "The Model K7 kettle draws 2200 watts and holds 1.7 litres.",
]


def _project(name: str) -> int:
    with session_scope() as s:
        return create_project(s, f"{name} {time.monotonic_ns()}").id


def _add(project_id: int, paths: list[Path]) -> list[int]:
    with session_scope() as s:
        from app.models import Project

        project = s.get(Project, project_id)
        received = [receive_local_file(p, dest_dir=settings.documents_dir,
                                       max_file_bytes=settings.max_upload_bytes) for p in paths]
        return [o.document_id for o in register_uploads(s, project, received)]


def _doc(doc_id: int) -> Document:
    with session_scope() as s:
        return s.get(Document, doc_id)


def _job(job_id: int) -> Job:
    with session_scope() as s:
        return s.get(Job, job_id)


def _train(project_id: int, extra: dict | None = None, **form) -> int:
    with session_scope() as s:  # the task leaves when this commits
        from app.models import Project

        job = create_job(s, s.get(Project, project_id), {"method": "lora", **form})
        job.params = {**job.params, **(extra or {})}
        return job.id


def _wait_state(job_id: int, states: set[str], timeout_s: float = 240) -> Job:
    return wait_for(lambda: (j := _job(job_id)).state in states and j, timeout_s,
                    f"job {job_id} to reach {states}")


def _ready_project(tmp_path: Path, name: str, repeat: int = 6) -> int:
    pid = _project(name)
    fx.make_txt(tmp_path / "facts.txt", FACTS * repeat)
    fx.make_qa_csv(tmp_path / "faq.csv", [("How long is the warranty?", "36 months"),
                                          ("Where does NW-4471 ship from?", "Lyon"),
                                          ("Who answers urgent tickets?", "Dana Whitfield")])
    ids = _add(pid, [tmp_path / "facts.txt", tmp_path / "faq.csv"])
    for doc_id in ids:
        wait_for(lambda d=doc_id: _doc(d).status != DocStatus.pending, 60, "extraction")
    return pid


def test_worker_extracts_uploads_and_marks_failures(tmp_path):
    pid = _project("ingest")
    fx.make_pdf(tmp_path / "manual.pdf", FACTS)
    fx.make_corrupt(tmp_path / "broken.docx")
    fx.make_txt(tmp_path / "blank.txt", ["   ", "\t"])
    fx.make_qa_csv(tmp_path / "faq.csv", [("How long is the warranty?", "36 months"),
                                          ("Who answers urgent tickets?", "")])
    ids = _add(pid, [tmp_path / "manual.pdf", tmp_path / "broken.docx", tmp_path / "blank.txt",
                     tmp_path / "faq.csv"])
    docs = [wait_for(lambda d=d: (x := _doc(d)).status != DocStatus.pending and x, 60, "extract")
            for d in ids]
    pdf, docx, blank, faq = docs
    assert pdf.status == DocStatus.extracted, pdf.error
    assert pdf.read_notes is None  # nothing skipped
    # What the reader skipped is kept, in words, for the document list.
    assert faq.status == DocStatus.extracted and faq.qa_count == 1
    assert faq.read_notes is not None and any("1 row" in n for n in faq.read_notes), faq.read_notes
    assert "NW-4471" in pdf.preview + " ".join(FACTS)
    assert pdf.word_count >= sum(len(f.split()) for f in FACTS) - 2
    assert docx.status == DocStatus.failed and "damaged" in docx.error
    assert blank.status == DocStatus.failed and "No text" in blank.error


def _counted_plan(project_id: int):
    """Ask for the project's dataset plan as its page does; wait for the worker's count."""
    from app.models import Project
    from app.services import planner
    from app.services.projects import corpus_of

    with session_scope() as s:
        assert planner.ask_for_plan(s.get(Project, project_id), corpus_of(s.get(Project, project_id)))

    def counted():
        with session_scope() as s:
            project = s.get(Project, project_id)
            corpus = corpus_of(project)
            return planner.dataset_plan(project, corpus,
                                        planner.default_params(corpus.n_words, corpus.n_qa))
    plan = wait_for(counted, 60, "the dataset plan")
    wait_for(planner.load_profile, 120, "the machine profile")  # the estimate needs both
    return plan


def test_a_job_trains_scores_and_exports(tmp_path):
    pid = _ready_project(tmp_path, "train")
    plan = _counted_plan(pid)  # the Train button's settings, counted by the worker
    job_id = _train(pid)
    job = _wait_state(job_id, {JobState.done, JobState.failed})
    assert job.state == JobState.done, job.error
    assert job.step == job.total_steps > 0
    # The plan counted the job's own dataset: the same examples and (the tiny model's replay
    # answers being as many as the plan counted) the same steps.
    stats = job.dataset
    assert job.estimate["counted"] and job.estimate["steps"] == plan.steps
    assert job.params["epochs"] == plan.epochs  # set from the dataset's tokens, alike
    assert plan.examples - plan.replay == stats["n_train_examples"] - stats["n_train_replay"]
    if stats["n_train_replay"] == plan.replay:
        assert plan.steps == job.total_steps
    assert len(job.loss_history) >= 2
    before, after = job.scores["before"], job.scores["after"]
    assert before["n_probes"] == after["n_probes"] > 0
    assert after["perplexity"] is None or after["perplexity"] > 0
    assert after["questions"]["n"] >= after["n_probes"]  # facts also asked as questions
    assert after["general"]["perplexity"] > 0  # the forgetting check
    assert job.export_errors == {} and set(job.scores) == {"before", "after"}  # scores only
    for kind in ("adapter", "merged", "gguf-f16", "gguf-q8_0"):
        assert not Path(job.artifacts[kind]).is_absolute()  # any machine's mount finds it
        path = settings.data_path(job.artifacts[kind])
        assert path.is_file() and path.stat().st_size > 0
        assert settings.data_dir in path.parents
    # It trained through the offload engine, whose figures reached the row; its swap is gone.
    t = job.telemetry
    assert t["blocks"] == 2 and t["mode"] == "frozen_base" and t["budget_bytes"] > 0
    assert t["blocks_read_from_weights_files"] == 2 and t["bytes_written"] == 0
    assert not (settings.swap_dir / str(job_id)).exists()


def test_the_worker_measures_the_machine_for_the_estimates():
    path = settings.machine_profile_path
    profile = wait_for(lambda: path.is_file() and json.loads(path.read_text()), 120, "profile")
    assert profile["base_model"] == settings.base_model
    assert profile["disk"]["read_gbps"] > 0 and profile["cpu"]["matmul_flops"] > 0
    assert profile["methods"]["lora"]["fits"] and profile["methods"]["full"]["fits"]
    for method in ("lora", "full"):  # the real (tiny) model timed through the offload engine
        timed = profile["steps"][method]
        assert [(r, w) for r, w, _ in timed["measured"]] == [(4, 64), (4, 128), (4, 256)]
        assert all(s > 0 for *_, s in timed["measured"]) and timed["s_per_flop"] > 0
        assert timed["checkpoint_s"] > 0  # one checkpoint of the run written and timed


def test_jobs_queue_one_after_another_and_cancel_works(tmp_path):
    pid = _ready_project(tmp_path, "queue", repeat=20)
    long_job = _train(pid, epochs="50")
    queued_job = _train(pid, epochs="1")
    _wait_state(long_job, {JobState.running})
    time.sleep(1)
    assert _job(queued_job).state == JobState.queued  # one training job at a time
    with session_scope() as s:
        assert request_cancel(s, s.get(Job, long_job))
    cancelled = _wait_state(long_job, {JobState.cancelled, JobState.done, JobState.failed}, 60)
    assert cancelled.state == JobState.cancelled
    done = _wait_state(queued_job, {JobState.done, JobState.failed})
    assert done.state == JobState.done, done.error
    assert done.started_at >= cancelled.finished_at


def test_a_killed_worker_resumes_the_job_from_its_checkpoint(tmp_path, celery_worker):
    pid = _ready_project(tmp_path, "crash", repeat=20)
    job_id = _train(pid, {"checkpoint_every": 3}, epochs="6")
    ckpt = settings.jobs_dir / str(job_id) / "checkpoint"
    wait_for(lambda: ckpt.exists() and _job(job_id).step >= 5, 180, "a checkpoint")
    celery_worker.stop(sig=signal.SIGKILL)  # the whole worker, pool included: a power cut
    assert _job(job_id).state == JobState.running  # nobody is left to say otherwise
    replacement = WorkerProcess("session").start()  # same node name: it knows the job is its
    celery_worker.proc = replacement.proc
    job = _wait_state(job_id, {JobState.done, JobState.failed})
    assert job.state == JobState.done, job.error
    assert job.attempts == 2
    steps = [s for s, _ in job.loss_history]
    assert steps == sorted(set(steps)) and steps[-1] == job.total_steps


def test_the_worker_refuses_hostile_files_in_words_and_reads_on(tmp_path):
    # The five files of issue 11's finding 4, uploaded as a user would: each is read in the
    # reader box of the real worker, fails in words within seconds, and the honest file
    # queued behind them is read as usual.
    from tests.worker.extract.test_sandbox import HOSTILE

    pid = _project("hostile")
    paths = [write(tmp_path / name) for name, (write, _words) in HOSTILE.items()]
    paths.append(fx.make_txt(tmp_path / "after.txt", FACTS))
    started = time.monotonic()
    ids = _add(pid, paths)
    rows = [wait_for(lambda d=d: (x := _doc(d)).status != DocStatus.pending and x, 90, "read")
            for d in ids]
    assert time.monotonic() - started < 90
    *refused, honest = rows
    for row, (name, (_write, words)) in zip(refused, HOSTILE.items(), strict=True):
        assert row.status == DocStatus.failed and words in row.error, name
        assert row.read_attempts == 1
    assert honest.status == DocStatus.extracted and "NW-4471" in Path(
        settings.documents_dir / f"{honest.stored_name}.txt").read_text()


def _pool_processes(worker: WorkerProcess) -> list[int]:
    """The Celery pool's processes: children of the worker with its own command line."""
    main = Path(f"/proc/{worker.proc.pid}/cmdline").read_bytes()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == worker.proc.pid and (
                (entry / "cmdline").read_bytes() == main
            ):
                found.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return found


def _reading_is_active() -> bool:
    """Whether the worker's main process lists a running task (remote control: inspect)."""
    from app.queue import celery_client

    active = celery_client.control.inspect(timeout=1.0).active() or {}
    return any(active.values())


def test_a_file_whose_reading_kills_its_worker_fails_once_not_forever(tmp_path, celery_worker):
    # Finding 5: the pool process reading a file dies (as the OOM killer would end it).
    # acks_late + reject_on_worker_lost deliver the task again at once; the redelivery finds
    # the attempt on the row and marks the file failed in words instead of reading it again.
    from tests.fixtures import hostile
    from worker.ingest import READ_BEFORE

    pid = _project("killer")
    (doc_id,) = _add(pid, [hostile.make_long_pdf(tmp_path / "slow.pdf", 1500)])
    wait_for(lambda: _doc(doc_id).read_attempts == 1, 60, "the reading to start")
    # The pool process writes the attempt when it starts the task, before the worker's main
    # process has heard that it accepted it. A kill in between is, as far as we can tell, why
    # two full CI runs on the 2-core AMD EPYC waited in vain (60 and 150 s): the main process
    # requeues at once only a task it counts as active; an unknown one waits for the broker's
    # visibility timeout. So the kill waits until the worker lists the task as active.
    wait_for(_reading_is_active, 60, "the worker to count the reading as active")
    pool = _pool_processes(celery_worker)
    assert len(pool) == 1
    os.kill(pool[0], signal.SIGKILL)
    # 5-8 s alone.
    row = wait_for(lambda: (x := _doc(doc_id)).status != DocStatus.pending and x, 150, "a verdict")
    assert row.status == DocStatus.failed and row.error == READ_BEFORE
    assert row.read_attempts == 1  # read once, never again
    assert celery_worker.proc.poll() is None  # the worker itself lives on
    # ...and reads the next file.
    (next_id,) = _add(pid, [fx.make_txt(tmp_path / "next.txt", FACTS)])
    assert wait_for(lambda: (x := _doc(next_id)).status != DocStatus.pending and x, 60,
                    "the next file").status == DocStatus.extracted
