"""The chat task's body: one reply to one question, streamed to the page through a Redis
stream (app/contract/chat.py) and kept in the database when done.

The message row says where the reply is: queued (waiting for the chat worker), running,
then done, stopped or failed. A reply whose worker died mid-way is delivered again by
Celery; it finds its row "running" and is marked failed in words instead of answered twice."""

from __future__ import annotations

import logging
import shutil
import socket
from pathlib import Path

import redis

from app.chat.models import ChatMessage, ReplyState
from app.contract.chat import (
    MAX_NEW_TOKENS,
    STREAM_TTL_S,
    ChatEvent,
    stop_key,
    stream_key,
)
from app.db import session_scope, utcnow
from app.models import Job, JobState
from app.settings import settings
from worker.chat.generate import generate, keep
from worker.chat.loaded import ChatModels, Version
from worker.chat.prompt import history_after, turn_ids
from worker.chat.stages import StageFailed, StageLost
from worker.errors import UserFacingError, ran_out_of

log = logging.getLogger(__name__)

INTERNAL_ERROR = ("DocTune could not answer this because of an unexpected problem; the "
                  "details are in the chat worker's log. Please ask again.")
STREAMED = ("Thinking… This model is larger than this machine's memory, so every word of "
            "the answer reads it from the disk: it comes slowly.")
INTERRUPTED = ("The chat worker stopped while answering this (it was restarted or ran out "
               "of memory). Please ask again.")
STAGE_LOST = ("The other machine that holds half of this model stopped answering ({}). "
              "Please ask again: the chat goes on with the machines that are free then.")

_models: ChatModels | None = None


def chat_models(node: str | None = None) -> ChatModels:
    """This worker's models (loaded on first use, kept while the worker lives). `node`: this
    chat worker's name, for a chat on two machines (DOCTUNE_CHAT_NODES): the second half is
    asked whether it is still there first, and found again when not."""
    global _models
    if _models is not None and _models.tail is not None and not _models.tail.alive():
        log.warning("chat: the second stage on %s is gone; finding the machines again",
                    _models.tail.node)
        drop_models()
    if _models is None:
        _models = _load_models(node or f"chat@{socket.gethostname()}")
    return _models


def drop_models() -> None:
    """Forget the models (after the second stage was lost): the next reply loads them."""
    global _models
    if _models is not None:
        if _models.tail is not None:
            _models.tail.close()
        _models.close()
    _models = None


def _load_models(me: str | None) -> ChatModels:
    """This worker's models; `me` None: on this machine alone."""
    from worker.chat.kv import attend_on_kv_heads
    from worker.training.base_model import resolve_base_model

    attend_on_kv_heads()  # this process answers chats only: cold and restored turns alike
    base = Path(resolve_base_model(settings.base_model, settings.models_dir))
    cache_dir = settings.chat_cache_dir
    cache_dir.mkdir(parents=True, exist_ok=True)
    budget = settings.offload_budget_mb * 2**20 if settings.offload_budget_mb else None
    tail = _second_stage(base, me) if me is not None else None
    return ChatModels(base, settings.data_dir / "chat" / "versions", cache_dir,
                      cache_bytes=chat_cache_bytes(cache_dir),
                      stream=settings.stream_base_model, budget_bytes=budget,
                      stage=0 if tail is not None else None, tail=tail)


def _second_stage(base: Path, me: str):
    """The second half of the model on another machine (worker/chat/head.py), when
    DOCTUNE_CHAT_NODES asks for it ("auto": when the model would not fit this machine's
    memory) and another machine's training worker is free; None: this machine alone."""
    if settings.chat_nodes == "1":
        return None
    if settings.chat_nodes == "auto":
        from worker.training.streamed import should_stream

        if not should_stream(base, settings.stream_base_model):
            return None
    from worker.chat.head import connect
    from worker.distributed.nodes import reserve_chat_peer

    peer = reserve_chat_peer(me)
    if peer is None:
        log.info("chat: no other machine is free; answering on this one")
        return None
    try:
        return connect(me, peer)
    except StageLost:
        log.exception("chat: the second stage on %s did not start; answering on this machine",
                      peer)
        return None


def chat_cache_bytes(cache_dir: Path) -> int:
    """DOCTUNE_CHAT_CACHE_MB, or a tenth of the disk's free space when the worker starts."""
    if settings.chat_cache_mb is not None:
        return settings.chat_cache_mb * 1024 * 1024
    return shutil.disk_usage(cache_dir).free // 10


class Events:
    """The reply's stream: appended in order, kept STREAM_TTL_S after the last event."""

    def __init__(self, message_id: int) -> None:
        self.client = redis.Redis.from_url(settings.broker_url)
        self.key = stream_key(message_id)
        self.stop = stop_key(message_id)

    def send(self, event: ChatEvent) -> None:
        pipe = self.client.pipeline()
        pipe.xadd(self.key, event.fields(), maxlen=20_000, approximate=True)
        pipe.expire(self.key, STREAM_TTL_S)
        pipe.execute()

    def stopped(self) -> bool:
        return bool(self.client.exists(self.stop))


Claimed = tuple[Version, list[int], list[dict], float, int]


def _claim(message_id: int, events: Events) -> Claimed | None:
    """Mark the reply running and gather what it needs (the version, the history's ids, the
    turns as text, the temperature, the most tokens); None when it must not run."""
    with session_scope() as session:
        message = session.get(ChatMessage, message_id)
        if message is None or message.role != "assistant":
            return None
        if message.state == ReplyState.running:  # delivered again after a crash
            message.state, message.error = ReplyState.failed, INTERRUPTED
            message.finished_at = utcnow()
            events.send(ChatEvent(kind="error", text=INTERRUPTED))
            return None
        if message.state != ReplyState.queued:
            return None
        if events.stopped():
            message.state, message.finished_at = ReplyState.stopped, utcnow()
            events.send(ChatEvent(kind="done", finish="stopped"))
            return None
        conversation = message.conversation
        version = Version(None)
        if conversation.job_id is not None:
            job = session.get(Job, conversation.job_id)
            if job is None or job.state != JobState.done:
                raise UserFacingError("This version is not finished, so it cannot chat.")
            kind = "adapter" if job.method == "lora" else "merged"
            raw = (job.artifacts or {}).get(kind)
            artifact = None
            if raw:
                artifact = settings.data_path(raw)
            version = Version(job.id, job.method, artifact)
        turns = _turns([m for m in conversation.messages if m.id < message_id])
        message.state, message.started_at = ReplyState.running, utcnow()
        most = min(MAX_NEW_TOKENS, message.max_new_tokens or MAX_NEW_TOKENS)
        return version, list(conversation.token_ids or []), turns, float(message.temperature), most


def _turns(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """The conversation as the model read it (a question with its passages from the
    documents), leaving out each failed reply and the question it failed on: neither is in
    the history's token ids."""
    failed = {i - 1 for i, m in enumerate(messages)
              if m.role == "assistant" and m.state == ReplyState.failed}
    return [{"role": m.role, "content": m.prompt_content or m.content}
            for i, m in enumerate(messages)
            if i not in failed and not (m.role == "assistant" and m.state == ReplyState.failed)]


def _finish(message_id: int, **fields) -> None:
    with session_scope() as session:
        message = session.get(ChatMessage, message_id)
        if message is None:
            return
        history = fields.pop("history", None)
        for key, value in fields.items():
            setattr(message, key, value)
        message.finished_at = utcnow()
        if history is not None:
            message.conversation.token_ids = history
            message.conversation.updated_at = utcnow()


def answer(message_id: int, node: str | None = None) -> str | None:
    """Answer one queued question (`node`: this chat worker's name); returns the reply's
    final state."""
    events = Events(message_id)
    try:
        claimed = _claim(message_id, events)
    except UserFacingError as exc:
        _finish(message_id, state=ReplyState.failed, error=str(exc))
        events.send(ChatEvent(kind="error", text=str(exc)))
        return ReplyState.failed
    if claimed is None:
        return None
    version, history, turns, temperature, most = claimed
    try:
        models = chat_models(node)
        if not models.loaded(version):
            events.send(ChatEvent(kind="status", text="Loading the model…"))
        with models.use(version, greedy=temperature <= 0) as loaded:
            prompt = turn_ids(loaded.tokenizer, history, turns)
            room = loaded.max_positions - len(prompt)
            if room < 16:
                raise UserFacingError("This conversation has become longer than the model can "
                                      "read. Start a new conversation to ask more.")
            events.send(ChatEvent(kind="status", text=STREAMED if loaded.streamed
                                  else "Thinking…"))
            reply = generate(
                loaded.model, loaded.tokenizer, loaded.store, prompt,
                max_new_tokens=min(most, room), temperature=temperature,
                seed=message_id, should_stop=events.stopped,
                on_text=lambda piece: events.send(ChatEvent(kind="token", text=piece)),
            )
            history = history_after(prompt, reply.ids, loaded.tokenizer)
            state = ReplyState.stopped if reply.finish == "stopped" else ReplyState.done
            _finish(message_id, state=state, content=reply.text, token_ids=reply.ids,
                    stats=reply.stats.model_dump(), history=history)
            events.send(ChatEvent(kind="done", finish=reply.finish))
            try:  # shown already: the cache for the next turn is a speed-up, not the answer
                keep(loaded.model, loaded.store, history, reply.cache)
            except Exception:
                log.exception("chat reply %s: could not keep its cache", message_id)
    except UserFacingError as exc:
        _finish(message_id, state=ReplyState.failed, error=str(exc))
        events.send(ChatEvent(kind="error", text=str(exc)))
        return ReplyState.failed
    except (StageLost, StageFailed) as exc:
        log.exception("chat reply %s: the second stage failed", message_id)
        drop_models()
        text = STAGE_LOST.format(exc if isinstance(exc, StageFailed) else "the link broke")
        _finish(message_id, state=ReplyState.failed, error=text)
        events.send(ChatEvent(kind="error", text=text))
        return ReplyState.failed
    except Exception as exc:
        log.exception("chat reply %s failed", message_id)
        text = INTERNAL_ERROR
        if ran_out_of(exc) == "memory":
            text = "The computer ran out of memory while answering. Close other programs, " \
                   "or start a new, shorter conversation."
        _finish(message_id, state=ReplyState.failed, error=text)
        events.send(ChatEvent(kind="error", text=text))
        return ReplyState.failed
    return state


def forget(job_id: int | None, token_ids: list[int]) -> int:
    """A deleted conversation's cache files, removed (the version is looked up by job)."""
    method = "lora"
    if job_id is not None:
        with session_scope() as session:
            job = session.get(Job, job_id)
            method = job.method if job is not None else "lora"
    # The models as they are; none loaded yet: without reaching for another machine (the
    # second stage's files of an earlier run wait for its disk cap).
    version, ids = Version(job_id, method), [int(t) for t in token_ids]
    if _models is not None:
        return _models.forget(version, ids)
    models = _load_models(None)  # made for this alone: closed after (its stores' threads)
    try:
        return models.forget(version, ids)
    finally:
        models.close()
