"""Small factories and request helpers for the web app tests."""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from app.db import utcnow
from app.models import DocStatus, Document, Job, JobState, Project, Worker

# A real (if minimal) one-page PDF: the web side only names, sizes and hashes it.
MINI_PDF = (
    b"%PDF-1.4\n1 0 obj<</Type/Catalog/Pages 2 0 R>>endobj\n"
    b"2 0 obj<</Type/Pages/Kids[3 0 R]/Count 1>>endobj\n"
    b"3 0 obj<</Type/Page/Parent 2 0 R/MediaBox[0 0 200 200]>>endobj\n"
    b"trailer<</Root 1 0 R>>\n%%EOF\n"
)


def htmx(target: str | None = None) -> dict[str, str]:
    """The headers htmx sends for a request aimed at the element with id `target`."""
    headers = {"HX-Request": "true"}
    if target:
        headers["HX-Target"] = target
    return headers


def make_project(session: Session, name: str = "Support FAQ") -> Project:
    project = Project(name=name)
    session.add(project)
    session.flush()
    return project


def make_document(
    session: Session,
    project: Project,
    name: str = "guide.txt",
    status: str = DocStatus.extracted,
    *,
    content: bytes | None = None,
    word_count: int = 400,
    qa_count: int = 0,
    preview: str = "The warranty lasts 24 months.",
    error: str | None = None,
) -> Document:
    content = content if content is not None else f"{name} {uuid.uuid4()}".encode()
    doc = Document(
        project=project,
        original_name=name,
        stored_name=f"{uuid.uuid4().hex}.txt",
        kind=name.rsplit(".", 1)[-1] if "." in name else "txt",
        size_bytes=len(content),
        sha256=hashlib.sha256(content).hexdigest(),
        status=status,
        word_count=word_count if status == DocStatus.extracted else 0,
        qa_count=qa_count if status == DocStatus.extracted else 0,
        preview=preview if status == DocStatus.extracted else "",
        error=error,
    )
    session.add(doc)
    session.flush()
    return doc


def sample_scores(
    n_probes: int = 10, before_hits: int = 1, after_hits: int = 6, qa: bool = True
) -> dict:
    def side(hits: int, ppl: float, tuned: bool) -> dict[str, Any]:
        probes = [
            {
                "prompt": f"Model X{i} has a warranty of",
                "answer": f"{20 + i} months",
                "output": f"{20 + i} months" if i < hits else "I do not know",
                "hit": i < hits,
                "source": "manual.pdf",
            }
            for i in range(n_probes)
        ]
        return {
            "perplexity": ppl,
            "n_heldout_chunks": 4,
            "recall": hits / n_probes,
            "n_probes": n_probes,
            "n_recalled": hits,
            "probes": probes,
            "qa": {
                "n": 5 if qa else 0,
                "f1": 0.62 if tuned else 0.18,
                "exact": 0.4 if tuned else 0.0,
                "items": [],
            },
        }

    return {"before": side(before_hits, 41.7, False), "after": side(after_hits, 12.3, True)}


def make_job(
    session: Session, project: Project, state: str = JobState.queued, **fields: Any
) -> Job:
    values: dict[str, Any] = {
        "method": "lora",
        "params": {
            "method": "lora",
            "epochs": 8,
            "learning_rate": 2e-4,
            "lora_rank": 16,
            "max_seq_len": 256,
        },
        "sources": [{"id": 1, "name": "manual.pdf", "sha256": "0" * 64}],
    }
    if state in (JobState.running, JobState.evaluating):
        values.update(
            step=40,
            total_steps=120,
            loss_history=[[i, 3.0 - i * 0.02] for i in range(0, 41, 5)],
            tokens_per_s=1834.5,
            eta_s=200.0,
            phase="Training on your documents",
        )
    if state == JobState.done:
        values.update(
            step=120,
            total_steps=120,
            loss_history=[[i, 3.0 - i * 0.015] for i in range(0, 121, 10)],
            scores=sample_scores(),
            phase="Done",
        )
    if state == JobState.failed:
        values.update(
            error="The computer ran out of memory while training. "
            "Try a shorter max sequence length."
        )
    values.update(fields)
    job = Job(project=project, state=state, **values)
    session.add(job)
    session.flush()
    return job


def make_worker(session: Session, node: str = "train@gpu-box", **fields: Any) -> Worker:
    """A registered worker, as worker/registry.py writes one: seen just now unless told."""
    now = utcnow()
    values: dict[str, Any] = {
        "host": node.partition("@")[2] or "gpu-box",
        "queues": ["node.gpu-box", "train"],
        "hardware": {"cpu": "AMD EPYC 9654 96-Core Processor", "cores": 16,
                     "ram_bytes": 128 * 2**30,
                     "gpus": [{"name": "NVIDIA H200", "memory_bytes": 143771 * 2**20}]},
        "version": "0.1.0",
        "started_at": now,
        "last_seen_at": now,
    }
    values.update(fields)
    worker = Worker(node=node, **values)
    session.add(worker)
    session.flush()
    return worker


def write_artifact(data_dir: Path, job_id: int, kind: str, size: int = 3 * 1024 * 1024) -> Path:
    """A zip-sized file where the worker would put it."""
    path = data_dir / "jobs" / str(job_id) / f"{kind}.zip"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(range(256)) * (size // 256))
    return path


def multipart(
    parts: list[tuple[bytes, bytes]], boundary: bytes = b"doctune-test-boundary"
) -> tuple[bytes, str]:
    """A hand-made multipart body: [(raw filename bytes, content)], all in field "files".

    Unlike an HTTP client, this leaves the filename exactly as given (control characters
    included), as a hostile client could."""
    body = b""
    for raw_name, content in parts:
        body += (
            b"--" + boundary + b"\r\n"
            b'Content-Disposition: form-data; name="files"; filename="' + raw_name + b'"\r\n'
            b"Content-Type: application/octet-stream\r\n\r\n" + content + b"\r\n"
        )
    body += b"--" + boundary + b"--\r\n"
    return body, f"multipart/form-data; boundary={boundary.decode()}"
