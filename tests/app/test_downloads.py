"""Downloads: all four kinds listed, large files streamed with HTTP range support (resume),
and an export that failed explained instead of offered."""

from __future__ import annotations

from app.db import session_scope
from app.models import Job, JobState

from .factories import make_job, make_project, sample_scores, write_artifact


def _done_job(env, kinds=("adapter", "merged", "gguf-f16", "gguf-q8_0"), **fields) -> int:
    with session_scope() as session:
        project = make_project(session, "Downloads")
        job = make_job(session, project, JobState.done, scores=sample_scores(), **fields)
        job_id = job.id
    paths = {k: write_artifact(env.data_dir, job_id, k, size=256 * 1024) for k in kinds}
    with session_scope() as session:
        session.get(Job, job_id).artifacts = {k: str(p) for k, p in paths.items()}
    return job_id


def test_all_four_downloads_are_offered(client, env):
    job_id = _done_job(env)
    page = client.get(f"/jobs/{job_id}").text
    for kind in ("adapter", "merged", "gguf-f16", "gguf-q8_0"):
        assert f'href="/jobs/{job_id}/download/{kind}"' in page
    assert "GGUF for llama.cpp / Ollama, 8-bit (.zip)" in page
    assert "with an Ollama Modelfile" in page
    r = client.get(f"/jobs/{job_id}/download/gguf-q8_0")
    assert r.status_code == 200
    assert f'filename="Downloads-job{job_id}-gguf-q8_0.zip"' in r.headers["content-disposition"]


def test_range_requests_resume_a_download(client, env):
    job_id = _done_job(env, kinds=("merged",))
    whole = client.get(f"/jobs/{job_id}/download/merged")
    assert whole.headers.get("accept-ranges") == "bytes"
    data = whole.content
    r = client.get(f"/jobs/{job_id}/download/merged", headers={"Range": "bytes=10-19"})
    assert r.status_code == 206
    assert r.content == data[10:20]
    assert r.headers["content-range"] == f"bytes 10-19/{len(data)}"
    assert r.headers["content-length"] == "10"
    # Resume from an offset to the end, as a download manager does after a broken connection.
    tail = client.get(
        f"/jobs/{job_id}/download/merged", headers={"Range": f"bytes={len(data) - 1000}-"}
    )
    assert tail.status_code == 206 and tail.content == data[-1000:]
    bad = client.get(
        f"/jobs/{job_id}/download/merged", headers={"Range": f"bytes={len(data) + 5}-"}
    )
    assert bad.status_code == 416


def test_a_failed_export_says_why_and_the_rest_stays(client, env):
    reason = "The GGUF file (q8_0) could not be made: the disk is full."
    job_id = _done_job(
        env, kinds=("adapter", "merged", "gguf-f16"), export_errors={"gguf-q8_0": reason}
    )
    page = client.get(f"/jobs/{job_id}").text
    assert reason in page and "The other downloads and the scores are not affected." in page
    assert f'href="/jobs/{job_id}/download/gguf-q8_0"' not in page
    assert f'href="/jobs/{job_id}/download/merged"' in page and "Did it get better?" in page
    r = client.get(f"/jobs/{job_id}/download/gguf-q8_0")
    assert r.status_code == 404 and reason in r.text
