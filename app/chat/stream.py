"""Following a reply as the chat worker writes it: its events from the Redis stream, in
order, from where the reader left off; while the stream is quiet, where the reply stands
according to the database (waiting in the queue, or finished with no events left, as after
a crash or once the stream expired). Used by the chat page's stream and the OpenAI API."""

from __future__ import annotations

from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from fastapi.concurrency import run_in_threadpool

from app.chat import service as chat
from app.chat.models import ChatMessage, ReplyState
from app.contract.chat import ChatEvent, stream_key
from app.db import session_scope
from app.settings import settings

QUIET_POLL_S = 2.0


def _standing(message_id: int) -> tuple[str, str]:
    """(state, words) of a reply from the database."""
    with session_scope() as session:
        message = session.get(ChatMessage, message_id)
        if message is None:
            return "gone", "This answer was deleted."
        state = ReplyState(message.state)
        if state == ReplyState.queued:
            n = chat.ahead_of(session, message)
            words = ("Waiting for the chat worker…" if n == 0 else
                     f"Waiting: {n} question{'s' if n != 1 else ''} ahead of yours.")
            return state.value, words
        return state.value, message.error or ""


async def follow(message_id: int, last: str = "0",
                 poll_s: float = QUIET_POLL_S) -> AsyncIterator[tuple[str | None, ChatEvent]]:
    """(stream entry id or None, event) until "done" or "error"."""
    key = stream_key(message_id)
    client = aioredis.Redis.from_url(settings.broker_url)
    try:
        while True:
            found = await client.xread({key: last}, block=int(poll_s * 1000), count=200)
            if not found:
                state, words = await run_in_threadpool(_standing, message_id)
                if state == ReplyState.queued:
                    yield None, ChatEvent(kind="status", text=words)
                elif state != ReplyState.running:  # finished, and its events are gone
                    failed = state in (ReplyState.failed, "gone")
                    yield None, ChatEvent(kind="error" if failed else "done", text=words)
                    return
                continue
            for entry_id, fields in found[0][1]:
                last = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                event = ChatEvent.from_fields(fields)
                yield last, event
                if event.kind in ("done", "error"):
                    return
    finally:
        await client.aclose()
