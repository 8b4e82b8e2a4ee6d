"""The OpenAI-compatible API with the official `openai` client against the real running
service (web app, Redis, the chat worker): the models listed by readable id, a reply with
and without streaming (the chunk shapes the client parses), the tokens restored from the
SSD reported as cached tokens, and a personal token that stops working once revoked."""

from __future__ import annotations

import openai
import pytest
import torch
from peft import PeftModel
from sqlalchemy import func, select
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.accounts import service as accounts
from app.accounts.models import ApiToken, User
from app.accounts.tokens import token_hash
from app.chat.models import Conversation
from app.chat.openai import api_models
from app.contract.chat import MAX_NEW_TOKENS
from app.db import session_scope
from app.models import Job, JobState, Project
from app.settings import settings
from tests.worker.models import save_tiny_adapter
from worker.chat.prompt import turn_ids

QUESTION = "Who approves orders over 500 units?"


def _token(role: str = "member") -> tuple[str, int]:
    with session_scope() as session:
        user = session.scalar(select(User).where(User.name == "api user"))
        user = user or accounts.create_user(session, "api user", role)
        return accounts.create_api_token(session, user, "tests"), user.id


def _project_with_version(tiny_base_model, name: str = "Sales Deck 2026!") -> tuple[str, int]:
    with session_scope() as session:
        project = Project(name=name)
        session.add(project)
        session.flush()
        job = Job(project=project, state=JobState.done, method="lora", params={}, sources=[])
        session.add(job)
        session.flush()
        project_id, job_id = project.id, job.id
    adapter = save_tiny_adapter(tiny_base_model, settings.jobs_dir / str(job_id) / "adapter.zip",
                                seed=7)
    with session_scope() as session:
        session.get(Job, job_id).artifacts = {"adapter": str(adapter)}
    with session_scope() as session:  # "sales-deck-2026", or with "-<id>" if taken already
        [base] = [m for m in api_models(session) if m.project_id == project_id and m.job_id is None]
    return base.id.removesuffix("/base"), job_id


def _expected(tiny_base_model, job_id: int) -> str:
    tokenizer = AutoTokenizer.from_pretrained(tiny_base_model)
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_base_model, dtype=torch.float32),
        settings.data_dir / "chat" / "versions" / f"v{job_id}").eval()
    prompt = turn_ids(tokenizer, [], [{"role": "user", "content": QUESTION}])
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS,
                             do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, len(prompt):], skip_special_tokens=True)


def test_the_openai_client_lists_models_and_gets_replies(live_server, chat_worker,
                                                         tiny_base_model):
    slug, job_id = _project_with_version(tiny_base_model)
    token, _user_id = _token()
    client = openai.OpenAI(base_url=f"{live_server}/v1", api_key=token, max_retries=0,
                           timeout=120)
    ids = {m.id for m in client.models.list()}
    assert {slug, f"{slug}/v1", f"{slug}/base"} <= ids

    reply = client.chat.completions.create(
        model=f"{slug}/v1", messages=[{"role": "user", "content": QUESTION}])
    text = reply.choices[0].message.content
    assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert text == _expected(tiny_base_model, job_id)  # greedy: what the model itself says
    assert reply.usage.completion_tokens > 0 and reply.usage.prompt_tokens > 0

    chunks = list(client.chat.completions.create(
        model=slug, messages=[{"role": "user", "content": QUESTION}], stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text  # "<project>" is the version in use: v1, the same answer
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] in ("stop", "length") and all(f is None for f in finals[:-1])
    usage = chunks[-1].usage  # the usage chunk comes last, with no choices
    assert chunks[-1].choices == [] and usage.prompt_tokens == reply.usage.prompt_tokens
    # The same question again: its prompt comes back from the SSD cache, all but the last
    # token (which must be run to get the first reply token's logits).
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1

    with session_scope() as session:  # each call's conversation is gone once it is answered
        assert session.scalar(select(func.count()).select_from(Conversation)
                              .where(Conversation.origin == "api")) == 0

    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-model",
                                       messages=[{"role": "user", "content": "Hi"}])
    assert "GET /v1/models" in str(missing.value)


def test_a_revoked_or_wrong_token_is_refused(live_server):
    token, user_id = _token()
    client = openai.OpenAI(base_url=f"{live_server}/v1", api_key=token, max_retries=0)
    assert client.models.list().data is not None
    with session_scope() as session:
        row = session.scalar(select(ApiToken).where(ApiToken.token_hash == token_hash(token)))
        accounts.revoke_api_token(session, session.get(User, user_id), row.id)
    for key in (token, "not-a-token"):
        bad = openai.OpenAI(base_url=f"{live_server}/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as refused:
            bad.models.list()
        assert "API token" in str(refused.value)


def _add_documents(project_id: int, texts: dict[str, str]) -> dict[str, int]:
    """Documents the reader has read: rows, and their text files where it leaves them."""
    from app.contract.documents import text_file
    from tests.app.factories import make_document

    settings.documents_dir.mkdir(parents=True, exist_ok=True)
    ids = {}
    with session_scope() as session:
        project = session.get(Project, project_id)
        for name, body in texts.items():
            doc = make_document(session, project, name)
            text_file(settings.documents_dir, doc.stored_name).write_text(body, encoding="utf-8")
            ids[name] = doc.id
    return ids


def test_a_model_id_with_documents_answers_from_them_and_names_them(live_server, chat_worker,
                                                                   tiny_base_model):
    """"<model>+documents": the chat page's "use my documents" through the API. The last
    question is read with the matching passages before it (the model's greedy answer to
    exactly that prompt comes back), and the documents drawn on come in the response's
    "doctune" field, streamed in the last chunk; "<project>+documents" is listed."""
    from app.chat.passages import prompt_with, search

    slug, job_id = _project_with_version(tiny_base_model, "Office handbook")
    with session_scope() as session:
        project_id = session.get(Job, job_id).project_id
    ids = _add_documents(project_id, {
        "logistics.txt": "Orders over 500 units are signed off by Dana Ruiz, Head of Logistics.",
        "kettle.txt": "The Model K7 kettle draws 2200 watts and holds 1.7 litres.",
    })
    token, _ = _token()
    client = openai.OpenAI(base_url=f"{live_server}/v1", api_key=token, max_retries=0,
                           timeout=120)
    assert f"{slug}+documents" in {m.id for m in client.models.list()}

    reply = client.chat.completions.create(
        model=f"{slug}/v1+documents", messages=[{"role": "user", "content": QUESTION}])
    sources = reply.model_extra["doctune"]["sources"]
    assert sources[0] == {"document_id": ids["logistics.txt"], "name": "logistics.txt"}
    with session_scope() as session:
        found = search(session, session.get(Project, project_id), QUESTION)
    tokenizer = AutoTokenizer.from_pretrained(tiny_base_model)
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_base_model, dtype=torch.float32),
        settings.data_dir / "chat" / "versions" / f"v{job_id}").eval()
    prompt = turn_ids(tokenizer, [], [{"role": "user", "content": prompt_with(QUESTION, found)}])
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS,
                             do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert reply.choices[0].message.content == tokenizer.decode(out[0, len(prompt):],
                                                                skip_special_tokens=True)
    plain = client.chat.completions.create(
        model=f"{slug}/v1", messages=[{"role": "user", "content": QUESTION}])
    assert "doctune" not in (plain.model_extra or {})  # without: no passages, no sources

    chunks = list(client.chat.completions.create(
        model=f"{slug}+documents", messages=[{"role": "user", "content": QUESTION}],
        stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply.choices[0].message.content
    assert chunks[-1].model_extra["doctune"]["sources"] == sources
