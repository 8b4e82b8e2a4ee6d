"""Chat pages: a project's conversations with one of its models, asking, the reply streamed
as Server-Sent Events from the chat worker's Redis stream, Stop, and deleting. Every
conversation is its owner's alone (another's answers 404, as a missing one does)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

import redis.asyncio as aioredis
from fastapi import APIRouter, Depends, Form, Header, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import RedirectResponse, Response
from fastapi.sse import EventSourceResponse, ServerSentEvent

from app.accounts.door import visitor_of
from app.chat import service as chat
from app.chat.markdown import render as markdown
from app.chat.models import ChatMessage
from app.chat.stream import follow
from app.contract.chat import BASE, STREAM_TTL_S, stop_key
from app.db import MAX_ROW_ID, RowId, SessionDep, session_scope
from app.services import projects as projects_service
from app.services.errors import InvalidInput
from app.services.uploads import display_name
from app.settings import settings

from .templating import is_htmx, render

router = APIRouter()

def _user_id(request: Request) -> int:
    visitor = visitor_of(request)
    assert visitor is not None  # the door let nobody else in
    return visitor.user_id


def _reply_context(message: ChatMessage) -> dict:
    return {"m": message, "html": markdown(message.content) if message.content else "",
            "project_id": message.conversation.project_id}


def _page(request: Request, session, project, conversation=None, *, model_ref: str = BASE,
          error: str | None = None, status_code: int = 200) -> Response:
    user_id = _user_id(request)
    if conversation is not None:
        model_ref = BASE if conversation.job_id is None else str(conversation.job_id)
    choices = chat.model_choices(project)
    readable = [d for d in project.documents if d.status == "extracted" and d.retired_at is None]
    context = {
        "project": project,
        "choices": choices,
        "saved": chat.saved_contexts(session, project, user_id),
        "documents": [(d.id, display_name(d.original_name)) for d in readable],
        "short_labels": {c.job_id: c.label.split(" ")[0] for c in choices},
        "model_label": next((c.label for c in choices if c.ref == model_ref), "?"),
        "how_often_right": (chat.how_often_right(session, conversation.job_id)
                            if conversation else None),
        "model_ref": model_ref,
        "conversations": chat.conversations_of(session, project, user_id),
        "conversation": conversation,
        "messages": [_reply_context(m) for m in conversation.messages] if conversation else [],
        "error": error,
    }
    return render(request, "chat.html", context, status_code=status_code)


@router.get("/projects/{project_id}/chat", name="chat")
def chat_page(request: Request, project_id: RowId, session: SessionDep,
              model: str = "") -> Response:
    """The project's chat: the latest version (or the one asked for) and your conversations."""
    project = projects_service.get_project(session, project_id)
    choices = chat.model_choices(project)
    ref = model if any(c.ref == model for c in choices) else choices[0].ref
    return _page(request, session, project, model_ref=ref)


@router.post("/projects/{project_id}/chat", name="new_conversation")
def new_conversation(request: Request, project_id: RowId, session: SessionDep,
                     model: Annotated[str, Form()] = BASE,
                     question: Annotated[str, Form()] = "",
                     temperature: Annotated[str, Form()] = "0",
                     use_documents: Annotated[str, Form()] = "") -> Response:
    """A new conversation with `model`, and its first question when one is given."""
    project = projects_service.get_project(session, project_id)
    conversation = chat.start_conversation(session, project, _user_id(request), model,
                                           use_documents=bool(use_documents))
    if question.strip():
        try:
            chat.ask(session, conversation, question, temperature)
        except InvalidInput as exc:
            session.rollback()
            return _page(request, session, project, model_ref=model, error=exc.message,
                         status_code=422)
    return RedirectResponse(f"/chat/{conversation.id}", status_code=303)


@router.get("/chat/{conversation_id}", name="conversation")
def conversation_page(request: Request, conversation_id: RowId, session: SessionDep) -> Response:
    conversation = chat.get_conversation(session, conversation_id, _user_id(request))
    project = projects_service.get_project(session, conversation.project_id)
    return _page(request, session, project, conversation)


@router.post("/chat/{conversation_id}/messages", name="ask")
def ask(request: Request, conversation_id: RowId, session: SessionDep,
        question: Annotated[str, Form()] = "",
        temperature: Annotated[str, Form()] = "0") -> Response:
    conversation = chat.get_conversation(session, conversation_id, _user_id(request))
    try:
        reply = chat.ask(session, conversation, question, temperature)
    except InvalidInput as exc:
        if is_htmx(request):
            return render(request, "chat.html", {"error": exc.message}, blocks=["ask_error"],
                          status_code=422)
        project = projects_service.get_project(session, conversation.project_id)
        return _page(request, session, project, conversation, error=exc.message,
                     status_code=422)
    if is_htmx(request):
        question_message = conversation.messages[-2]
        context = {"messages": [_reply_context(question_message), _reply_context(reply)]}
        return render(request, "chat.html", context, blocks=["new_messages"], status_code=201)
    return RedirectResponse(f"/chat/{conversation.id}", status_code=303)


@router.get("/chat/replies/{message_id}", name="reply")
def reply_fragment(request: Request, message_id: RowId, session: SessionDep) -> Response:
    """One reply as shown once finished (Markdown rendered), for the page to swap in."""
    message = chat.get_reply(session, message_id, _user_id(request))
    return render(request, "chat.html", {"messages": [_reply_context(message)]},
                  blocks=["new_messages"])


@router.post("/chat/replies/{message_id}/stop", name="stop_reply")
async def stop_reply(request: Request, message_id: RowId, session: SessionDep) -> Response:
    """Stop a reply: the worker ends it before its next token (what came so far is kept)."""
    await run_in_threadpool(chat.get_reply, session, message_id, _user_id(request))
    client = aioredis.Redis.from_url(settings.broker_url)
    try:
        await client.set(stop_key(message_id), "1", ex=STREAM_TTL_S)
    finally:
        await client.aclose()
    return Response(status_code=204)


@router.post("/chat/{conversation_id}/delete", name="delete_conversation")
def delete_conversation(request: Request, conversation_id: RowId, session: SessionDep) -> Response:
    conversation = chat.get_conversation(session, conversation_id, _user_id(request))
    project_id = conversation.project_id
    chat.delete_conversation(session, conversation)
    return RedirectResponse(f"/projects/{project_id}/chat", status_code=303)


def _owned_reply(request: Request, message_id: RowId) -> int:
    """The reply's id once it is known to be the visitor's (404 before any streaming)."""
    with session_scope() as session:
        chat.get_reply(session, message_id, _user_id(request))
    return message_id


@router.get("/chat/replies/{message_id}/events", name="reply_events",
            response_class=EventSourceResponse)
async def reply_events(
    message_id: Annotated[int, Depends(_owned_reply)],
    last_event_id: Annotated[str | None, Header()] = None,
) -> AsyncIterator[ServerSentEvent]:
    """The reply as it is made: "status", "token" (the next piece of text), then "done" or
    "error". A reconnecting browser sends Last-Event-ID and gets only what it missed. (Its
    own short database sessions: a stream may stay open for minutes.)"""
    last = last_event_id if last_event_id and len(last_event_id) < 40 else "0"
    async for entry_id, event in follow(message_id, last):
        yield ServerSentEvent(event=event.kind, id=entry_id,
                              data={"text": event.text, "finish": event.finish})


# Compare: the same questions to two models (or one, with and without the documents)


@router.post("/projects/{project_id}/chat/compare", name="new_compare")
def new_compare(request: Request, project_id: RowId, session: SessionDep,
                a: Annotated[str, Form()] = BASE, b: Annotated[str, Form()] = BASE,
                a_documents: Annotated[str, Form()] = "",
                b_documents: Annotated[str, Form()] = "",
                question: Annotated[str, Form()] = "") -> Response:
    project = projects_service.get_project(session, project_id)
    try:
        group = chat.start_compare(session, project, _user_id(request),
                                   [(a, bool(a_documents)), (b, bool(b_documents))])
        if question.strip():
            chat.ask_both(session, chat.compare_pair(session, group, _user_id(request)),
                          question)
    except InvalidInput as exc:
        session.rollback()
        return _page(request, session, project, error=exc.message, status_code=422)
    return RedirectResponse(f"/chat/compare/{group}", status_code=303)


def _compare_page(request: Request, session, group: str, error: str | None = None,
                  status_code: int = 200) -> Response:
    pair = chat.compare_pair(session, group, _user_id(request))
    project = projects_service.get_project(session, pair[0].project_id)
    choices = {c.job_id: c.label for c in chat.model_choices(project)}
    sides = [{"conversation": c,
              "label": choices.get(c.job_id, "?") + (" + your documents" if c.use_documents
                                                     else ""),
              "how_often_right": chat.how_often_right(session, c.job_id),
              "messages": [_reply_context(m) for m in c.messages]} for c in pair]
    context = {"project": project, "group": group, "sides": sides, "error": error}
    return render(request, "chat_compare.html", context, status_code=status_code)


@router.get("/chat/compare/{group}", name="compare_chat")
def compare_page(request: Request, group: str, session: SessionDep) -> Response:
    return _compare_page(request, session, group[:32])


@router.post("/chat/compare/{group}/messages", name="ask_both")
def ask_both(request: Request, group: str, session: SessionDep,
             question: Annotated[str, Form()] = "",
             temperature: Annotated[str, Form()] = "0") -> Response:
    pair = chat.compare_pair(session, group[:32], _user_id(request))
    try:
        chat.ask_both(session, pair, question, temperature)
    except InvalidInput as exc:
        session.rollback()
        return _compare_page(request, session, group[:32], exc.message, status_code=422)
    return RedirectResponse(f"/chat/compare/{group[:32]}", status_code=303)


# Saved contexts


@router.post("/chat/{conversation_id}/save", name="save_context")
def save_context(request: Request, conversation_id: RowId, session: SessionDep,
                 name: Annotated[str, Form()] = "") -> Response:
    conversation = chat.get_conversation(session, conversation_id, _user_id(request))
    try:
        chat.save_context(session, conversation, name)
    except InvalidInput as exc:
        project = projects_service.get_project(session, conversation.project_id)
        return _page(request, session, project, conversation, error=exc.message,
                     status_code=422)
    return RedirectResponse(f"/chat/{conversation.id}", status_code=303)


@router.post("/chat/{conversation_id}/start", name="start_from_context")
def start_from_context(request: Request, conversation_id: RowId, session: SessionDep) -> Response:
    saved = chat.get_conversation(session, conversation_id, _user_id(request))
    copy = chat.start_from(session, saved)
    return RedirectResponse(f"/chat/{copy.id}", status_code=303)


@router.post("/projects/{project_id}/chat/read", name="read_document")
def read_document(request: Request, project_id: RowId, session: SessionDep,
                  model: Annotated[str, Form()] = BASE,
                  document_id: Annotated[int, Form(le=MAX_ROW_ID)] = 0) -> Response:
    """A conversation that starts by reading one whole document (to save as a context)."""
    project = projects_service.get_project(session, project_id)
    conversation = chat.read_document(session, project, _user_id(request), model, document_id)
    return RedirectResponse(f"/chat/{conversation.id}", status_code=303)
