"""The OpenAI-compatible API: GET /v1/models and POST /v1/chat/completions, with and
without streaming, for a personal API token (`Authorization: Bearer ...`; see
app/accounts/door.py) or a signed-in session. Replies come from the same chat worker as the
chat page's; errors have OpenAI's shape ({"error": {"message", "type", "code"}})."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from sqlalchemy import delete

from app.accounts.door import visitor_of
from app.chat import openai as shapes
from app.chat import service as chat
from app.chat.models import ChatMessage, Conversation
from app.chat.stream import follow
from app.contract.chat import openai_error
from app.db import SessionDep, session_scope
from app.services.errors import InvalidInput, NotFound

router = APIRouter()


def error(status: int, message: str, code: str | None = None) -> JSONResponse:
    return JSONResponse(openai_error(status, message, code), status_code=status)


@router.get("/v1/models")
def list_models(session: SessionDep) -> dict:
    return {"object": "list", "data": [
        {"id": m.id, "object": "model", "created": m.created, "owned_by": "doctune"}
        for m in shapes.api_models(session)]}


def _queue(user_id: int, wanted: shapes.ChatRequest) -> tuple[int, str]:
    """The reply's message id, committed (so its task is on its way)."""
    with session_scope() as session:
        model = shapes.find_model(session, wanted.model)
        if model is None:
            raise NotFound(f"There is no model “{wanted.model[:100]}”; GET /v1/models lists "
                           "them.")
        messages = [("system" if m.role == "developer" else m.role, m.text())
                    for m in wanted.messages]
        reply = chat.ask_api(session, model.project_id, model.job_id, user_id, messages,
                             wanted.temperature or 0.0,
                             wanted.max_completion_tokens or wanted.max_tokens,
                             use_documents=model.documents)
        return reply.id, model.id


def _finished(message_id: int) -> ChatMessage | None:
    """The finished reply, read once: its request's conversation is then deleted (an API
    call is stateless; the model's cache of its tokens stays on the SSD for the next)."""
    with session_scope() as session:
        message = session.get(ChatMessage, message_id)
        if message is not None:
            session.expunge(message)
            session.execute(delete(Conversation).where(
                Conversation.id == message.conversation_id, Conversation.origin == "api"))
        return message


def _sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


async def _stream(message_id: int, model: str, with_usage: bool) -> AsyncIterator[bytes]:
    created = int(time.time())
    yield _sse(shapes.chunk(message_id, model, {"role": "assistant", "content": ""},
                            created=created))
    finish = None
    async for _entry, event in follow(message_id):
        if event.kind == "token":
            yield _sse(shapes.chunk(message_id, model, {"content": event.text},
                                    created=created))
        elif event.kind == "error":
            await run_in_threadpool(_finished, message_id)
            yield _sse(openai_error(500, event.text))
            yield _sse("[DONE]")
            return
        elif event.kind == "done":
            finish = event.finish or "stop"
    message = await run_in_threadpool(_finished, message_id)
    yield _sse(shapes.chunk(message_id, model, {}, finish, created=created)
               | shapes.sources_field(message.sources if message else None))
    if with_usage:
        yield _sse({**shapes.chunk(message_id, model, {}, created=created), "choices": [],
                    "usage": shapes.usage(message.stats if message else None)})
    yield _sse("[DONE]")


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(request: Request) -> Response:
    try:
        wanted = shapes.ChatRequest.model_validate(await request.json())
    except (ValueError, ValidationError) as exc:
        first = exc.errors()[0] if isinstance(exc, ValidationError) else None
        where = ".".join(str(p) for p in first["loc"]) if first else "body"
        text = first["msg"] if first else "The body is not JSON."
        return error(400, f"{where}: {text}")
    visitor = visitor_of(request)
    assert visitor is not None  # the door let nobody else in
    try:
        message_id, model = await run_in_threadpool(_queue, visitor.user_id, wanted)
    except NotFound as exc:
        return error(404, exc.message, code="model_not_found")
    except InvalidInput as exc:
        return error(400, exc.message)
    if wanted.stream:
        with_usage = bool(wanted.stream_options and wanted.stream_options.include_usage)
        return StreamingResponse(_stream(message_id, model, with_usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    finish, failure = None, None
    async for _entry, event in follow(message_id):
        if event.kind == "done":
            finish = event.finish
        elif event.kind == "error":
            failure = event.text
    message = await run_in_threadpool(_finished, message_id)
    if failure is not None:
        return error(500, failure)
    return JSONResponse({
        "id": shapes.completion_id(message_id), "object": "chat.completion",
        "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "finish_reason": shapes.finish_reason(finish),
                     "message": {"role": "assistant", "content": message.content}}],
        "usage": shapes.usage(message.stats),
    } | shapes.sources_field(message.sources))
