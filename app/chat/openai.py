"""The OpenAI-compatible face of the chat (/v1/models, /v1/chat/completions): the models'
readable ids and the request and response shapes, as the OpenAI API reference gives them,
so that the tools people already use (the `openai` client, editors, notebooks) can talk
to a DocTune model with a personal API token.

Model ids: "<project>/v2" for a version, "<project>/base" for the base model, and plain
"<project>" for the version in use, where <project> is the project's name in lower case
with anything but letters, digits and dashes made a dash (and "-<id>" added when two
projects would read the same). Any of them with DOCUMENTS ("+documents") after it answers
from the project's documents, as the chat page's "use my documents" switch does: passages
found in them go into the prompt, and the documents drawn on come back in the response's
"doctune" field (streamed: in the last chunk). /v1/models lists "<project>+documents" for
each project, so a tool that only lets its user pick a model can reach it too."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.contract.chat import BASE, MAX_NEW_TOKENS, TEMPERATURE_MAX
from app.models import Project
from app.services.documents import model_versions
from app.services.jobs import current_version

DOCUMENTS = "+documents"


@dataclass(frozen=True)
class ApiModel:
    id: str
    project_id: int
    job_id: int | None  # None: the base model
    created: int
    documents: bool = False  # answers from the project's documents


def find_model(session: Session, wanted: str) -> ApiModel | None:
    """The model of id `wanted`, with or without DOCUMENTS after it."""
    plain = wanted.removesuffix(DOCUMENTS)
    model = next((m for m in api_models(session) if m.id == plain and not m.documents), None)
    if model is None or plain == wanted:
        return model
    return ApiModel(wanted, model.project_id, model.job_id, model.created, documents=True)


def sources_field(sources: list[dict] | None) -> dict:
    """DocTune's addition to a response: the documents the answer drew on (with DOCUMENTS),
    as the chat page lists them (document_id, name)."""
    return {} if sources is None else {"doctune": {"sources": sources}}


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "project"


def api_models(session: Session) -> list[ApiModel]:
    """Every project's versions, its base model and its version in use, by readable id."""
    projects = list(session.scalars(select(Project).order_by(Project.id)))
    slugs = [_slug(p.name) for p in projects]
    out: list[ApiModel] = []
    for project, slug in zip(projects, slugs, strict=True):
        if slugs.count(slug) > 1:
            slug = f"{slug}-{project.id}"
        created = int(project.created_at.timestamp()) if project.created_at else 0
        jobs = {j.id: j for j in project.jobs}
        versions = model_versions(project)
        in_use = current_version(project)
        if in_use is not None:
            out.append(ApiModel(slug, project.id, in_use.id, created))
            out.append(ApiModel(slug + DOCUMENTS, project.id, in_use.id, created, True))
        for job_id, label in versions.items():
            finished = jobs[job_id].finished_at or jobs[job_id].created_at
            out.append(ApiModel(f"{slug}/{label}", project.id, job_id,
                                int(finished.timestamp()) if finished else created))
        out.append(ApiModel(f"{slug}/{BASE}", project.id, None, created))
    return out


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer"]
    # A string, or the newer list of parts of which only the text parts are read.
    content: str | list[dict] | None = ""

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(str(p.get("text", "")) for p in self.content
                           if p.get("type") == "text")
        return self.content or ""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ChatRequest(BaseModel):
    """POST /v1/chat/completions; fields DocTune does not use are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[Message] = Field(min_length=1, max_length=500)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0, le=TEMPERATURE_MAX)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_NEW_TOKENS)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_NEW_TOKENS)
    n: int = Field(default=1, ge=1, le=1)


def completion_id(message_id: int) -> str:
    return f"chatcmpl-doctune-{message_id}"


def usage(stats: dict | None) -> dict:
    stats = stats or {}
    prompt = int(stats.get("prompt_tokens", 0))
    new = int(stats.get("new_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": new, "total_tokens": prompt + new,
            "prompt_tokens_details": {"cached_tokens": int(stats.get("restored_tokens", 0))}}


def finish_reason(finish: str | None) -> str:
    """OpenAI's words: "stop" at the end of turn (and when stopped), "length" at the limit."""
    return "length" if finish == "length" else "stop"


def chunk(message_id: int, model: str, delta: dict, finish: str | None = None,
          created: int | None = None) -> dict:
    return {"id": completion_id(message_id), "object": "chat.completion.chunk",
            "created": created or int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta,
                         "finish_reason": finish_reason(finish) if finish else None}]}
