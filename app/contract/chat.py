"""What the chat page and the chat worker agree on (besides the task and queue, which are
app/contract/tasks.py's): the Redis keys a reply streams through, the events on that
stream, and the bounds of a request. Pure
Python (pydantic), validated where the worker writes an event and where the app reads it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

# Which model a conversation talks to: the base model, or a finished job's version.
BASE = "base"

MAX_NEW_TOKENS = 512
TEMPERATURE_MAX = 2.0
MAX_QUESTION_CHARS = 8000
# A stream is kept this long after its last event, for a page that reconnects late.
STREAM_TTL_S = 3600


def stream_key(message_id: int) -> str:
    """The Redis stream a reply's events are appended to (XADD), in order."""
    return f"doctune:chat:{message_id}:events"


def stop_key(message_id: int) -> str:
    """Set (to "1") by the app when the user presses Stop; the worker looks before each token."""
    return f"doctune:chat:{message_id}:stop"


class ChatEvent(BaseModel):
    """One event of a reply's stream.

    - "status": queued/loading/thinking text for the page (`text`);
    - "token": the next piece of the reply's text (`text`, already decoded);
    - "done": the reply is complete (`finish`: "stop" at the end of turn, "length" at the
      token limit, "stopped" when the user stopped it);
    - "error": it failed; `text` says why, in words."""

    kind: Literal["status", "token", "done", "error"]
    text: str = ""
    finish: Literal["stop", "length", "stopped"] | None = None

    def fields(self) -> dict[str, str]:
        """As stored in the Redis stream (flat strings)."""
        return {"event": self.model_dump_json()}

    @classmethod
    def from_fields(cls, fields: dict[bytes | str, bytes | str]) -> ChatEvent:
        raw = fields.get(b"event", fields.get("event", b"{}"))
        return cls.model_validate_json(raw)


class ReplyStats(BaseModel):
    """How a finished reply was made (kept on the message; shown small under it)."""

    prompt_tokens: int = Field(ge=0)
    restored_tokens: int = Field(ge=0)  # of the prompt, restored from the SSD cache
    new_tokens: int = Field(ge=0)
    first_token_s: float = Field(ge=0)
    tokens_per_s: float = Field(ge=0)


def openai_error(status: int, message: str, code: str | None = None) -> dict:
    """The body of an error from /v1 in OpenAI's shape, which its clients read the message
    from (the web app's error handlers, its front door and the API routes all use it)."""
    kind = {401: "authentication_error", 404: "not_found_error"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
