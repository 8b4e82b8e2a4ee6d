"""What the chat pages do: the models a project can chat with, a person's conversations
(each visible to its owner only), asking a question (the reply is queued for the chat
worker after the commit) and where a queued reply stands. Each function works inside the
caller's database session; the caller commits."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.chat import passages
from app.chat.models import ChatMessage, Conversation, ReplyState
from app.contract.chat import BASE, MAX_QUESTION_CHARS, TEMPERATURE_MAX
from app.contract.scores import headline_recall, parse_scores
from app.contract.tasks import CHAT_FORGET_TASK, CHAT_TASK
from app.contract.verdict import colleague_words
from app.db import utcnow
from app.models import Job, JobState, Project
from app.queue import enqueue_after_commit
from app.services.documents import model_versions
from app.services.errors import InvalidInput, NotFound


@dataclass(frozen=True)
class ModelChoice:
    ref: str  # "base" or the job id, as in the page's address
    label: str
    job_id: int | None


def model_choices(project: Project) -> list[ModelChoice]:
    """The base model, then every finished version, newest first."""
    versions = model_versions(project)
    jobs = {j.id: j for j in project.jobs}
    methods = {"lora": "LoRA", "full": "full fine-tuning"}
    tuned = [ModelChoice(str(job_id), f"{label} ({methods.get(jobs[job_id].method, '?')})",
                         job_id) for job_id, label in sorted(versions.items(), reverse=True)]
    return [*tuned, ModelChoice(BASE, "Base model (not tuned)", None)]


def how_often_right(session: Session, job_id: int | None) -> str | None:
    """A version's score card in a sentence, for the chat beside its answers: a tuned model
    answers in the documents' style whether it is right or not (neither its token
    probabilities nor its sampled answers tell the two apart: README "Does the model know
    when it is wrong?"), so the reader is told how often it was right on questions it was
    never trained on. None for the base model or a version without scores."""
    job = session.get(Job, job_id) if job_id is not None else None
    if job is None or not job.scores:
        return None
    try:
        scores = parse_scores(job.scores)
    except ValueError:
        return None
    if scores.after is None:
        return None
    recall = headline_recall(scores.before, scores.after)
    if not recall.n:
        return None
    pct = round(100 * recall.rate_after)
    if recall.kind == "questions":
        line = (f"On its score card it answered {recall.after} of {recall.n} questions about "
                f"your documents right ({pct}%).")
        if recall.colleague_after is not None:  # what a colleague would see (the card's figure)
            line = f"{line[:-1]}: {colleague_words(recall.colleague_after)}."
        return line
    return (f"On its score card it completed {recall.after} of {recall.n} facts from your "
            f"documents ({pct}%).")


def choice_for(project: Project, ref: str) -> ModelChoice:
    for choice in model_choices(project):
        if choice.ref == ref:
            return choice
    raise NotFound("This project has no such model version to chat with.")


def model_label(project: Project, job_id: int | None) -> str:
    return choice_for(project, BASE if job_id is None else str(job_id)).label


def conversations_of(session: Session, project: Project, user_id: int) -> list[Conversation]:
    return list(session.scalars(
        select(Conversation)
        .where(Conversation.project_id == project.id, Conversation.user_id == user_id,
               Conversation.origin == "page")
        .order_by(Conversation.updated_at.desc(), Conversation.id.desc())
    ))


def get_conversation(session: Session, conversation_id: int, user_id: int) -> Conversation:
    """The conversation if it is this person's: another's is as absent as a missing one."""
    conversation = session.get(Conversation, conversation_id)
    if conversation is None or conversation.user_id != user_id:
        raise NotFound("There is no such conversation.")
    return conversation


def get_reply(session: Session, message_id: int, user_id: int) -> ChatMessage:
    message = session.get(ChatMessage, message_id)
    if message is None or message.role != "assistant" or message.conversation.user_id != user_id:
        raise NotFound("There is no such answer.")
    return message


def start_conversation(session: Session, project: Project, user_id: int, ref: str,
                       use_documents: bool = False,
                       compare_group: str | None = None) -> Conversation:
    choice = choice_for(project, ref)
    conversation = Conversation(project_id=project.id, user_id=user_id, job_id=choice.job_id,
                                token_ids=[], use_documents=use_documents,
                                compare_group=compare_group)
    session.add(conversation)
    session.flush()
    return conversation


def _temperature(raw: str | None) -> float:
    raw = (raw or "0").strip().replace(",", ".")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= TEMPERATURE_MAX:
        raise InvalidInput(f"The temperature must be a number from 0 (always the most likely "
                           f"answer) to {TEMPERATURE_MAX:g}.", {"temperature": "out of range"})
    return value


def ask(session: Session, conversation: Conversation, question: str,
        temperature: str | None = None, prompt: str | None = None) -> ChatMessage:
    """Add the question and a queued reply; the chat worker gets it once this commits.
    One reply at a time per conversation: a follow-up needs the answer before it.
    `prompt`: what the model reads instead of the question as shown (a whole document)."""
    question = question.strip()
    if not question:
        raise InvalidInput("Type a question first.", {"question": "empty"})
    if len(question) > MAX_QUESTION_CHARS:
        raise InvalidInput(f"A question may be at most {MAX_QUESTION_CHARS:,} characters; "
                           f"this one has {len(question):,}.", {"question": "too long"})
    value = _temperature(temperature)
    if conversation.job_id is not None:
        job = session.get(Job, conversation.job_id)
        if job is None or job.state != JobState.done:
            raise InvalidInput("This version is not available to chat with any more.")
    pending = [m for m in conversation.messages
               if m.role == "assistant" and not m.reply_state.finished]
    if pending:
        raise InvalidInput("Please wait for the answer to the last question (or stop it) "
                           "before asking the next one.", {"question": "busy"})
    now = utcnow()
    if not conversation.messages:
        conversation.title = question if len(question) <= 80 else question[:79] + "…"
    found = []
    if conversation.use_documents and prompt is None:
        found = passages.search(session, session.get(Project, conversation.project_id), question)
    session.add(ChatMessage(conversation=conversation, role="user", content=question,
                            prompt_content=prompt or (passages.prompt_with(question, found)
                                                      if found else None), created_at=now))
    reply = ChatMessage(conversation=conversation, role="assistant", state=ReplyState.queued,
                        temperature=value, created_at=now,
                        sources=passages.sources(found) if conversation.use_documents else None)
    session.add(reply)
    conversation.updated_at = now
    session.flush()
    enqueue_after_commit(session, CHAT_TASK, reply.id)
    return reply


def ahead_of(session: Session, reply: ChatMessage) -> int:
    """How many questions (anyone's) the chat worker answers before this queued one."""
    return session.scalar(
        select(func.count()).select_from(ChatMessage).where(
            ChatMessage.role == "assistant", ChatMessage.id < reply.id,
            ChatMessage.state.in_([ReplyState.queued.value, ReplyState.running.value]))
    )


def delete_conversation(session: Session, conversation: Conversation) -> None:
    """Gone with its messages; once that commits, the chat worker deletes its SSD cache."""
    if conversation.token_ids:
        enqueue_after_commit(session, CHAT_FORGET_TASK, conversation.job_id,
                             list(conversation.token_ids))
    session.delete(conversation)
    session.flush()


def ask_api(session: Session, project_id: int, job_id: int | None, user_id: int,
            messages: list[tuple[str, str]], temperature: float,
            max_new_tokens: int | None, use_documents: bool = False) -> ChatMessage:
    """One /v1/chat/completions request: a conversation of its own (not listed on the
    chat page) holding the request's messages, and its reply queued after the commit.
    `use_documents`: the last question is read with the passages of the project's
    documents that match it, and the reply names the documents (as on the chat page)."""
    if job_id is not None:
        job = session.get(Job, job_id)
        if job is None or job.state != JobState.done:
            raise NotFound("This model version is not available.")
    if not messages or messages[-1][0] != "user":
        raise InvalidInput("The last message must be the user's question.")
    conversation = Conversation(project_id=project_id, user_id=user_id, job_id=job_id,
                                origin="api", token_ids=[], title=messages[-1][1][:200],
                                use_documents=use_documents)
    session.add(conversation)
    found = []
    if use_documents:
        found = passages.search(session, session.get(Project, project_id), messages[-1][1])
    for n, (role, content) in enumerate(messages):
        if len(content) > 20 * MAX_QUESTION_CHARS:
            raise InvalidInput("A message is too long for this model.")
        last = n == len(messages) - 1
        session.add(ChatMessage(conversation=conversation, role=role, content=content,
                                prompt_content=passages.prompt_with(content, found)
                                if last and found else None))
    reply = ChatMessage(conversation=conversation, role="assistant", state=ReplyState.queued,
                        temperature=temperature, max_new_tokens=max_new_tokens,
                        sources=passages.sources(found) if use_documents else None)
    session.add(reply)
    session.flush()
    enqueue_after_commit(session, CHAT_TASK, reply.id)
    return reply


# Compare: two conversations asked the same questions, side by side


def start_compare(session: Session, project: Project, user_id: int,
                  sides: list[tuple[str, bool]]) -> str:
    """Two conversations (model ref, use documents) in one compare group; its id."""
    if len(sides) != 2 or sides[0] == sides[1]:
        raise InvalidInput("Choose two different models (or the same one with and without "
                           "your documents) to compare.", {"compare": "same"})
    group = uuid.uuid4().hex
    for ref, use_documents in sides:
        start_conversation(session, project, user_id, ref, use_documents, group)
    return group


def compare_pair(session: Session, group: str, user_id: int) -> list[Conversation]:
    pair = list(session.scalars(
        select(Conversation).where(Conversation.compare_group == group,
                                   Conversation.user_id == user_id).order_by(Conversation.id)))
    if len(pair) != 2:
        raise NotFound("There is no such comparison.")
    return pair


def ask_both(session: Session, pair: list[Conversation], question: str,
             temperature: str | None = None) -> list[ChatMessage]:
    """The same question to both sides (both queued in one transaction, or neither)."""
    return [ask(session, conversation, question, temperature) for conversation in pair]


# Saved contexts: a conversation (say, one that read a long document) kept under a name;
# new conversations start from its history, which the SSD cache already holds.

DOCUMENT_WORDS = 3000  # a document read into a context: at most this many words (~4k tokens)


def save_context(session: Session, conversation: Conversation, name: str) -> None:
    name = " ".join(name.split())[:100]
    if not name:
        raise InvalidInput("Give the saved context a name.", {"name": "empty"})
    if any(not m.reply_state.finished for m in conversation.messages if m.role == "assistant"):
        raise InvalidInput("Wait for the answer before saving this conversation.")
    if not conversation.token_ids:
        raise InvalidInput("Ask something first: an empty conversation has nothing to keep.")
    conversation.saved_as = name


def saved_contexts(session: Session, project: Project, user_id: int) -> list[Conversation]:
    return [c for c in conversations_of(session, project, user_id) if c.saved_as]


def start_from(session: Session, saved: Conversation) -> Conversation:
    """A new conversation holding the saved one's turns and token ids (its next question
    restores all of them from the SSD)."""
    if not saved.saved_as:
        raise NotFound("There is no such saved context.")
    copy = Conversation(project_id=saved.project_id, user_id=saved.user_id, job_id=saved.job_id,
                        use_documents=saved.use_documents, token_ids=list(saved.token_ids),
                        title=f"From “{saved.saved_as}”")
    session.add(copy)
    for m in saved.messages:
        if m.role == "assistant" and m.state == ReplyState.failed:
            continue
        session.add(ChatMessage(conversation=copy, role=m.role, content=m.content,
                                prompt_content=m.prompt_content, state=m.state,
                                temperature=m.temperature, token_ids=m.token_ids,
                                sources=m.sources, created_at=m.created_at))
    session.flush()
    return copy


def read_document(session: Session, project: Project, user_id: int, ref: str,
                  document_id: int) -> Conversation:
    """A new conversation whose first turn gives the model one whole document to read (up
    to about DOCUMENT_WORDS words), to save as a context and ask about later."""
    doc = next((d for d in project.documents if d.id == document_id
                and d.status == "extracted" and d.retired_at is None), None)
    if doc is None:
        raise NotFound("There is no such document in this project.")
    words = passages.document_text(doc).split()
    cut = len(words) > DOCUMENT_WORDS
    body = " ".join(words[:DOCUMENT_WORDS]) + (" […]" if cut else "")
    name = passages.display_name(doc.original_name)
    conversation = start_conversation(session, project, user_id, ref)
    prompt = f"Here is our document “{name}”. Read it; I will ask you about it.\n\n{body}"
    ask(session, conversation, f"Read “{name}”" + (" (its beginning)" if cut else ""),
        prompt=prompt)
    conversation.title = f"Reading “{name}”"
    return conversation
