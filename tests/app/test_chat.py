"""The chat pages on the web side (app/chat/, app/routes/chat.py): which models a project
offers, conversations visible to their owner only, asking (a reply queued for the chat
worker after the commit, one at a time per conversation), Stop, the reply's event stream
read from the real Redis, and replies' Markdown rendered without any way to run script.
The chat worker itself is tested in tests/worker/chat/ and tests/e2e/test_chat.py."""

from __future__ import annotations

import json
import re

import pytest
from sqlalchemy import select

from app.chat.markdown import render as markdown
from app.chat.models import ChatMessage, Conversation, ReplyState
from app.contract.chat import ChatEvent, stop_key, stream_key
from app.contract.tasks import CHAT_QUEUE
from app.db import session_scope
from app.main import create_app
from app.models import JobState, Project
from tests.app.web import local_client

from .factories import htmx, make_job, make_project


def _project_with_version() -> tuple[int, int]:
    with session_scope() as session:
        project = make_project(session, "Handbook")
        make_job(session, project, JobState.failed)  # not a version
        job = make_job(session, project, JobState.done)
        return project.id, job.id


def _replies() -> list[ChatMessage]:
    with session_scope() as session:
        return list(session.scalars(select(ChatMessage).where(ChatMessage.role == "assistant")
                                    .order_by(ChatMessage.id)))


def _queued_ids(env) -> list[int]:
    """Message ids in the chat queue's Celery messages (kombu's Redis list)."""
    import base64

    out = []
    for raw in env.redis.lrange(CHAT_QUEUE, 0, -1):
        body = json.loads(base64.b64decode(json.loads(raw)["body"]))
        out.append(body[0][0])
    return sorted(out)


def test_the_chat_offers_the_versions_and_the_base_model(client):
    project_id, job_id = _project_with_version()
    page = client.get(f"/projects/{project_id}/chat").text
    assert f'<option value="{job_id}" selected>v1 (LoRA)</option>' in page
    assert '<option value="base">Base model (not tuned)</option>' in page
    offered = set(re.findall(r'<option value="([^"]+)"', page))
    assert offered == {str(job_id), "base"}  # in every select; the failed job is no version
    job_page = client.get(f"/jobs/{job_id}").text
    assert f'href="/projects/{project_id}/chat?model={job_id}"' in job_page


def test_a_conversation_says_how_often_its_version_was_right(client):
    """Beside a tuned version's answers, its score card's figure on questions it never
    trained on, taken from the job's own scores; the base model (no card) gets none."""
    from tests.app.test_score_card import full_scores, with_kinds

    # Its questions by kind: 13 right, the first five the other way round (all right), then
    # 8 of 16 forward and none of eight from a table.
    kinded = with_kinds(full_scores(n=29, after_hits=13),
                        ["reverse"] * 5 + ["other words"] * 16 + ["table"] * 8)
    with session_scope() as session:
        project = make_project(session, "Handbook")
        old = make_job(session, project, JobState.done)  # sentence completions: 6 of 10
        new = make_job(session, project, JobState.done, scores=full_scores(n=29, after_hits=13))
        both = make_job(session, project, JobState.done, scores=kinded)
        ids = project.id, old.id, new.id, both.id
    project_id, old_id, new_id, kinded_id = ids

    def header(model: str, documents: bool = False) -> str:
        r = client.post(f"/projects/{project_id}/chat", follow_redirects=False,
                        data={"model": model, "use_documents": "1" if documents else ""})
        page = client.get(r.headers["location"]).text
        found = re.search(r'<p class="hint how-often-right">(.*?)</p>', page, re.DOTALL)
        return found.group(1) if found else ""

    line = header(str(new_id))
    assert line.startswith("On its score card it answered 13 of 29 questions about your "
                           "documents right (45%).")
    assert "or start a conversation that uses them" in line
    assert "completed 6 of 10 facts from your documents (60%)" in header(str(old_id))
    # With kinds, what a colleague would see beside it: the forward half at colleagues' odds
    # (a third), the other kinds as answered: (5 + 16/3) of 29.
    assert header(str(kinded_id)).startswith(
        "On its score card it answered 13 of 29 questions about your documents right (45%): "
        "a colleague asking in their own words would get about 36% right.")
    assert "start a conversation that uses them" not in header(str(new_id), documents=True)
    assert header("base") == ""


def test_asking_queues_one_reply_after_the_commit(client, env):
    project_id, job_id = _project_with_version()
    r = client.post(f"/projects/{project_id}/chat",
                    data={"model": str(job_id), "question": "How many days of leave?"},
                    follow_redirects=False)
    assert r.status_code == 303
    conversation_id = int(r.headers["location"].rsplit("/", 1)[1])
    [reply] = _replies()
    assert reply.state == ReplyState.queued and reply.temperature == 0
    assert _queued_ids(env) == [reply.id]
    page = client.get(f"/chat/{conversation_id}").text
    assert "How many days of leave?" in page  # the title and the question
    assert f'data-reply-stream="/chat/replies/{reply.id}/events"' in page
    # A follow-up waits for the answer: refused in words, nothing queued.
    r = client.post(f"/chat/{conversation_id}/messages", data={"question": "And sick days?"},
                    headers=htmx("messages"))
    assert r.status_code == 422 and "wait for the answer" in r.text
    assert _queued_ids(env) == [reply.id]
    with session_scope() as session:
        message = session.get(ChatMessage, reply.id)
        message.state, message.content = ReplyState.done, "**25** days."
    r = client.post(f"/chat/{conversation_id}/messages",
                    data={"question": "And sick days?", "temperature": "0.7"},
                    headers=htmx("messages"))
    assert r.status_code == 201
    assert "And sick days?" in r.text and "<html" not in r.text  # two bubbles, no page
    first, second = _replies()
    assert second.temperature == pytest.approx(0.7)
    assert _queued_ids(env) == [first.id, second.id]
    page = client.get(f"/chat/{conversation_id}").text
    assert "<strong>25</strong> days." in page  # the finished reply's Markdown


@pytest.mark.parametrize("form,words", [
    ({"question": "   "}, "Type a question first."),
    ({"question": "x" * 8001}, "at most 8,000 characters"),
    ({"question": "Hi", "temperature": "9"}, "temperature must be a number from 0"),
    ({"question": "Hi", "temperature": "warm"}, "temperature must be a number from 0"),
])
def test_a_question_that_cannot_be_asked_says_why(client, env, form, words):
    project_id, _ = _project_with_version()
    r = client.post(f"/projects/{project_id}/chat", data={"model": "base"},
                    follow_redirects=False)
    conversation_id = int(r.headers["location"].rsplit("/", 1)[1])
    r = client.post(f"/chat/{conversation_id}/messages", data=form)
    assert r.status_code == 422 and words in r.text
    assert _replies() == [] and _queued_ids(env) == []


def test_a_conversation_is_its_owners_alone(env):
    project_id, _ = _project_with_version()
    app = create_app()
    with local_client(app, role="member") as member:
        r = member.post(f"/projects/{project_id}/chat", data={"model": "base", "question": "Q?"},
                        follow_redirects=False)
        conversation_id = int(r.headers["location"].rsplit("/", 1)[1])
    [reply] = _replies()
    with local_client(app) as admin:  # even an admin does not read others' conversations
        assert "Q?" not in admin.get(f"/projects/{project_id}/chat").text
        for method, path in (("GET", f"/chat/{conversation_id}"),
                             ("POST", f"/chat/{conversation_id}/messages"),
                             ("GET", f"/chat/replies/{reply.id}"),
                             ("GET", f"/chat/replies/{reply.id}/events"),
                             ("POST", f"/chat/replies/{reply.id}/stop"),
                             ("POST", f"/chat/{conversation_id}/delete")):
            r = admin.request(method, path, data={"question": "x"} if method == "POST" else None)
            assert r.status_code == 404, (method, path)
    assert not env.redis.exists(stop_key(reply.id))
    with local_client(app, role="viewer") as viewer:  # a viewer asks too, in their own
        r = viewer.post(f"/projects/{project_id}/chat",  # conversations, and sees no other
                        data={"model": "base", "question": "Mine?"}, follow_redirects=False)
        assert r.status_code == 303
        assert "Q?" not in viewer.get(f"/projects/{project_id}/chat").text
        assert viewer.post(f"/chat/{conversation_id}/delete").status_code == 404
        # Asking changes no project: anything else a viewer sends is still refused.
        assert viewer.post(f"/projects/{project_id}/jobs", data={}).status_code == 403
        assert viewer.post(f"/projects/{project_id}/inbox", data={}).status_code == 403
    with session_scope() as session:
        assert session.get(Conversation, conversation_id) is not None
        mine = session.scalars(select(Conversation).where(Conversation.title == "Mine?")).all()
        assert len(mine) == 1 and mine[0].user_id != session.get(
            Conversation, conversation_id).user_id


def test_stop_sets_the_flag_the_worker_looks_at(client, env):
    project_id, _ = _project_with_version()
    client.post(f"/projects/{project_id}/chat", data={"model": "base", "question": "Q?"})
    [reply] = _replies()
    assert client.post(f"/chat/replies/{reply.id}/stop").status_code == 204
    assert env.redis.get(stop_key(reply.id)) == b"1"
    assert 0 < env.redis.ttl(stop_key(reply.id)) <= 3600


def _sse(text: str) -> list[tuple[str, dict]]:
    events = []
    for block in text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "event" in fields:
            events.append((fields["event"], json.loads(fields["data"])))
    return events


def test_the_event_stream_relays_the_workers_events_in_order(client, env):
    project_id, _ = _project_with_version()
    client.post(f"/projects/{project_id}/chat", data={"model": "base", "question": "Q?"})
    [reply] = _replies()
    for event in (ChatEvent(kind="status", text="Thinking…"), ChatEvent(kind="token", text="Hel"),
                  ChatEvent(kind="token", text="lo <b>"), ChatEvent(kind="done", finish="stop")):
        env.redis.xadd(stream_key(reply.id), event.fields())  # as worker/chat/reply.py does
    r = client.get(f"/chat/replies/{reply.id}/events")
    assert r.headers["content-type"].startswith("text/event-stream")
    assert _sse(r.text) == [("status", {"text": "Thinking…", "finish": None}),
                            ("token", {"text": "Hel", "finish": None}),
                            ("token", {"text": "lo <b>", "finish": None}),
                            ("done", {"text": "", "finish": "stop"})]
    # A browser that reconnects after the second event gets only the rest.
    second = env.redis.xrange(stream_key(reply.id))[1][0].decode()
    r = client.get(f"/chat/replies/{reply.id}/events", headers={"Last-Event-ID": second})
    assert [kind for kind, _ in _sse(r.text)] == ["token", "done"]


def test_a_queued_reply_says_where_it_stands_and_a_lost_one_ends(client, env):
    project_id, _ = _project_with_version()
    client.post(f"/projects/{project_id}/chat", data={"model": "base", "question": "Q?"})
    [reply] = _replies()
    with session_scope() as session:  # a finished reply whose stream expired
        message = session.get(ChatMessage, reply.id)
        message.state, message.error = ReplyState.failed, "The chat worker stopped."
    r = client.get(f"/chat/replies/{reply.id}/events")
    assert _sse(r.text) == [("error", {"text": "The chat worker stopped.", "finish": None})]


def test_markdown_keeps_formatting_and_drops_anything_active():
    table = "| a | b |\n|--|--|\n|1|2|"
    html = str(markdown(f"**bold** [docs](https://example.org/x) `code`\n\n{table}"))
    assert "<strong>bold</strong>" in html and "<code>code</code>" in html and "<table>" in html
    assert '<a href="https://example.org/x" rel="noopener noreferrer nofollow">docs</a>' in html
    for hostile in ("<script>alert(1)</script>", "<img src=x onerror=alert(1)>",
                    "[x](javascript:alert(1))", "[x](JAVASCRIPT:alert(1))",
                    "[x](data:text/html,<script>alert(1)</script>)",
                    "![t](https://evil.test/p.png)",
                    '<a href="javascript:alert(1)">x</a>', "[x](vbscript:msgbox(1))"):
        out = str(markdown(hostile))
        tags = re.findall(r"<[a-z][^>]*>", out)  # the elements the renderer made
        assert all(t.split()[0].strip("<>") in ("p", "a", "code", "pre") for t in tags), out
        assert not any(re.search(r"\son\w+=", t) for t in tags), out
        hrefs = re.findall(r'href="([^"]*)"', out)
        assert all(h.startswith(("https://", "http://", "mailto:")) for h in hrefs), out


# Use my documents, and compare ------------------------------------------------------------


def _project_with_texts(env, texts: dict[str, str]) -> tuple[int, dict[str, int]]:
    """A project whose documents were read: their text files where the reader leaves them."""
    from app.contract.documents import text_file
    from app.settings import settings

    from .factories import make_document

    settings.documents_dir.mkdir(parents=True, exist_ok=True)
    ids = {}
    with session_scope() as session:
        project = make_project(session, "Office")
        make_job(session, project, JobState.done)
        for name, body in texts.items():
            doc = make_document(session, project, name)
            text_file(settings.documents_dir, doc.stored_name).write_text(body, encoding="utf-8")
            ids[name] = doc.id
        return project.id, ids


OFFICE = {
    "handbook.txt": "Annual leave is 25 days a year. Unused leave may be carried over until "
                    "March.\n\nThe office opens at 8:00 and closes at 18:00.",
    "logistics.txt": "Orders over 500 units are signed off by Dana Ruiz, Head of Logistics.",
    "kettle.txt": "The Model K7 kettle draws 2200 watts and holds 1.7 litres.",
}


def test_documents_put_the_best_passages_before_the_question(client, env):
    project_id, ids = _project_with_texts(env, OFFICE)
    r = client.post(f"/projects/{project_id}/chat",
                    data={"model": "base", "use_documents": "1",
                          "question": "Who signs off orders over 500 units?"},
                    follow_redirects=False)
    conversation_id = int(r.headers["location"].rsplit("/", 1)[1])
    with session_scope() as session:
        question, reply = session.get(Conversation, conversation_id).messages
        assert question.content == "Who signs off orders over 500 units?"  # as typed
        prompt, sources = question.prompt_content, reply.sources
    assert prompt.startswith("Answer from these passages")
    assert "[1] From “logistics.txt”:\nOrders over 500 units are signed off by Dana Ruiz" in prompt
    assert prompt.endswith("Question: Who signs off orders over 500 units?")
    assert sources[0] == {"document_id": ids["logistics.txt"], "name": "logistics.txt"}
    with session_scope() as session:
        session.get(ChatMessage, reply.id).state = ReplyState.done
    page = client.get(f"/chat/{conversation_id}").text
    assert f'href="/projects/{project_id}#preview-{ids["logistics.txt"]}">logistics.txt</a>' in page


def test_the_search_takes_any_words_as_plain_text(client, env):
    from app.chat import passages

    project_id, ids = _project_with_texts(env, OFFICE)
    with session_scope() as session:
        project = session.get(Project, project_id)
        for hostile in ('kettle" OR 1=1 --', "NEAR(kettle watts)", "*", "kettle AND NOT",
                        "^'\"%_;", "watts)"):
            found = passages.search(session, project, hostile)
            assert all(f.document_id in ids.values() for f in found), hostile
        assert passages.search(session, project, "?!") == []
        [first, *_] = passages.search(session, project, "How much does the kettle hold?")
        assert first.document_id == ids["kettle.txt"]
        # A retired version of a file is not searched.
        from app.db import utcnow
        from app.models import Document

        session.get(Document, ids["kettle.txt"]).retired_at = utcnow()
        session.flush()
        found = passages.search(session, project, "How much does the kettle hold?")
        assert ids["kettle.txt"] not in {f.document_id for f in found}


def test_long_text_is_cut_into_paragraph_sized_passages():
    from app.chat.passages import split_passages

    body = "\n\n".join(f"Paragraph {i}. " + "word " * 50 for i in range(6))
    parts = split_passages(body, words=120)
    assert all(len(p.split()) <= 120 for p in parts)
    assert " ".join(" ".join(parts).split()) == " ".join(body.split())  # nothing lost
    huge = split_passages("x " * 1000, words=120)
    assert len(huge) == 9 and all(len(p.split()) <= 120 for p in huge)


def test_compare_asks_both_sides_the_same_question(client, env):
    project_id, _ = _project_with_texts(env, OFFICE)
    page = client.get(f"/projects/{project_id}/chat").text
    version = re.search(r'<option value="(\d+)"', page).group(1)
    r = client.post(f"/projects/{project_id}/chat/compare",
                    data={"a": version, "b": version, "b_documents": "1",
                          "question": "How long is annual leave?"}, follow_redirects=False)
    assert r.status_code == 303
    group = r.headers["location"].rsplit("/", 1)[1]
    with session_scope() as session:
        pair = list(session.scalars(select(Conversation).where(
            Conversation.compare_group == group).order_by(Conversation.id)))
        assert [(c.job_id, c.use_documents) for c in pair] == [(int(version), False),
                                                               (int(version), True)]
        assert [[m.content for m in c.messages if m.role == "user"] for c in pair] == [
            ["How long is annual leave?"]] * 2
    assert len(_queued_ids(env)) == 2
    page = client.get(f"/chat/compare/{group}").text
    assert "+ your documents" in page and page.count("data-reply-stream") == 2
    # Both sides are the same version: its score card's figure above each.
    assert page.count('<p class="hint how-often-right">On its score card it') == 2
    same = client.post(f"/projects/{project_id}/chat/compare", data={"a": "base", "b": "base"})
    assert same.status_code == 422 and "Choose two different models" in same.text


def test_saving_a_context_and_reading_a_document(client, env):
    from app.chat import service as chat_service

    long_text = " ".join(f"word{i}" for i in range(3500))
    project_id, ids = _project_with_texts(env, {**OFFICE, "long.txt": long_text})
    r = client.post(f"/projects/{project_id}/chat/read",
                    data={"model": "base", "document_id": str(ids["long.txt"])},
                    follow_redirects=False)
    conversation_id = int(r.headers["location"].rsplit("/", 1)[1])
    with session_scope() as session:
        conversation = session.get(Conversation, conversation_id)
        question, reply = conversation.messages
        assert conversation.title == "Reading “long.txt”"
        assert question.content == "Read “long.txt” (its beginning)"  # as shown
        words = question.prompt_content.split()  # as the model reads it: 3,000 words
        assert "word2999" in words and "word3000" not in words
    assert _queued_ids(env) == [reply.id]
    # Not saved while the answer is pending, nor without a name.
    r = client.post(f"/chat/{conversation_id}/save", data={"name": "Long"})
    assert r.status_code == 422 and "Wait for the answer" in r.text
    with session_scope() as session:
        message = session.get(ChatMessage, reply.id)
        message.state, message.content = ReplyState.done, "Read."
        message.conversation.token_ids = [1, 2, 3]
    assert client.post(f"/chat/{conversation_id}/save", data={"name": " "}).status_code == 422
    assert client.post(f"/chat/{conversation_id}/save", data={"name": "Long"}).status_code == 200
    r = client.post(f"/chat/{conversation_id}/start", follow_redirects=False)
    copy_id = int(r.headers["location"].rsplit("/", 1)[1])
    with session_scope() as session:
        copy = session.get(Conversation, copy_id)
        assert copy.token_ids == [1, 2, 3] and copy.saved_as is None
        assert [(m.role, m.content, m.prompt_content) for m in copy.messages] == [
            ("user", "Read “long.txt” (its beginning)", question.prompt_content),
            ("assistant", "Read.", None)]
        project = session.get(Project, copy.project_id)
        saved = chat_service.saved_contexts(session, project, copy.user_id)
        assert [c.saved_as for c in saved] == ["Long"]
    # Starting from a conversation that is not saved is refused.
    assert client.post(f"/chat/{copy_id}/start").status_code == 404


def test_a_deleted_replys_id_is_never_given_again(client, env):
    """A reply's Redis stream is named by its id: a new reply taking a deleted one's id
    would show the old reply's events (SQLite reuses the highest rowid unless told not to)."""
    project_id, _ = _project_with_version()
    seen = []
    for _ in range(2):
        r = client.post(f"/projects/{project_id}/chat", data={"model": "base", "question": "Q?"},
                        follow_redirects=False)
        conversation_id = int(r.headers["location"].rsplit("/", 1)[1])
        [reply] = _replies()
        seen.append((conversation_id, reply.id))
        assert client.post(f"/chat/{conversation_id}/delete").status_code == 200
    (c1, m1), (c2, m2) = seen
    assert c2 > c1 and m2 > m1
