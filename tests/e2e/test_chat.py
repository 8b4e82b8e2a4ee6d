"""Chat end to end, in a real Chromium: the web app, Redis and the chat worker process, a
version that is a LoRA adapter on the tiny base model. The reply streams into the page, is
exactly what greedy decoding of that model gives, the follow-up restores the whole history
from the SSD cache, and the base model's conversation really runs without the adapter."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from playwright.sync_api import expect, sync_playwright
from sqlalchemy import select
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.chat.models import ChatMessage, Conversation
from app.contract.chat import MAX_NEW_TOKENS
from app.db import session_scope
from app.main import create_app
from app.models import Job, JobState, Project
from app.settings import settings
from offload.kvcache import KVStore
from tests.app.web import add_session_cookie, local_client, signed_in_headers
from tests.conftest import CHROMIUM_ARGS, wait_for
from tests.worker.models import save_tiny_adapter
from worker.chat.kv import model_fingerprint
from worker.chat.prompt import history_after, turn_ids

pytestmark = pytest.mark.browser

QUESTION = "How many days of annual leave do we get?"
FOLLOW_UP = "And how do I book them?"


def _version(tiny_base_model, tmp_path) -> tuple[int, int]:
    with session_scope() as session:
        project = Project(name=f"Chat handbook {tmp_path.name}")  # names are unique
        session.add(project)
        session.flush()
        job = Job(project=project, state=JobState.done, method="lora", params={},
                  sources=[])
        session.add(job)
        session.flush()
        project_id, job_id = project.id, job.id
    adapter = save_tiny_adapter(tiny_base_model, settings.jobs_dir / str(job_id) / "adapter.zip")
    with session_scope() as session:
        session.get(Job, job_id).artifacts = {"adapter": str(adapter)}
    return project_id, job_id


def _greedy(model, tokenizer, prompt: list[int]) -> list[int]:
    """What the reply must be: transformers' own greedy generate, no cache of ours."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS,
                             do_sample=False, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.eos_token_id)
    return out[0, len(prompt):].tolist()


def _replies(conversation_id: int) -> list[ChatMessage]:
    with session_scope() as session:
        return list(session.scalars(
            select(ChatMessage).where(ChatMessage.conversation_id == conversation_id,
                                      ChatMessage.role == "assistant").order_by(ChatMessage.id)))


def _member_page(pw, chromium_path: str, live_server: str):
    """Chromium signed in as the tests' member: (browser, page, the page's script errors)."""
    browser = pw.chromium.launch(executable_path=chromium_path, args=CHROMIUM_ARGS)
    page = browser.new_page()
    add_session_cookie(page.context, live_server, role="member")
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    return browser, page, errors


def _first_question(page) -> int:
    """Ask QUESTION from the chat page's first form; the new conversation's id once its
    answer is shown."""
    page.fill("#first-question", QUESTION)
    page.click(".ask-form button[type=submit]")
    page.wait_for_url("**/chat/*")
    expect(page.locator(".msg-done")).to_have_count(1, timeout=120_000)
    return int(page.url.rsplit("/", 1)[1])


def _conversation(conversation_id: int) -> Conversation:
    with session_scope() as session:
        return session.get(Conversation, conversation_id)


def test_ask_stream_follow_up_and_the_base_model(live_server, chat_worker, chromium_path,
                                                 tiny_base_model, tmp_path):
    project_id, job_id = _version(tiny_base_model, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_base_model)
    base = AutoModelForCausalLM.from_pretrained(tiny_base_model, dtype=torch.float32).eval()
    with sync_playwright() as pw:
        browser, page, errors = _member_page(pw, chromium_path, live_server)
        streams: list[str] = []
        page.on("response", lambda r: streams.append(r.url) if "/events" in r.url else None)
        page.set_default_timeout(60_000)

        page.goto(f"{live_server}/jobs/{job_id}")
        page.click("text=Try it: chat with this version")
        page.wait_for_url(f"**/projects/{project_id}/chat?model={job_id}")
        conversation_id = _first_question(page)
        assert streams and "/events" in streams[0]  # the page followed the reply's stream

        page.fill("#question", FOLLOW_UP)
        page.click("#ask-form button[type=submit]")
        expect(page.locator(".msg-done")).to_have_count(2, timeout=120_000)
        expect(page.locator(".msg-user")).to_have_count(2)
        meta = page.locator(".msg-done .msg-meta").nth(1).inner_text()
        assert "restored from the SSD" in meta

        # The base model, in its own conversation with the same question.
        page.goto(f"{live_server}/projects/{project_id}/chat?model=base")
        base_conversation = _first_question(page)
        browser.close()
    assert errors == []

    tuned = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_base_model, dtype=torch.float32),
        settings.data_dir / "chat" / "versions" / f"v{job_id}").eval()
    first, second = _replies(conversation_id)
    prompt = turn_ids(tokenizer, [], [{"role": "user", "content": QUESTION}])
    assert first.token_ids == _greedy(tuned, tokenizer, prompt)
    assert first.content == tokenizer.decode(first.token_ids, skip_special_tokens=True)
    history = history_after(prompt, first.token_ids, tokenizer)
    turns = [{"role": "user", "content": QUESTION},
             {"role": "assistant", "content": first.content},
             {"role": "user", "content": FOLLOW_UP}]
    prompt2 = turn_ids(tokenizer, history, turns)
    assert second.token_ids == _greedy(tuned, tokenizer, prompt2)  # restored == cold
    assert second.stats["restored_tokens"] == len(history)  # the whole first turn, from the SSD
    assert second.stats["prompt_tokens"] == len(prompt2)
    assert _conversation(conversation_id).token_ids == history_after(
        prompt2, second.token_ids, tokenizer)

    [base_reply] = _replies(base_conversation)
    assert base_reply.token_ids == _greedy(base, tokenizer, prompt)  # no adapter at all
    assert base_reply.token_ids != first.token_ids  # and the adapter does change the answer

    # Deleting the conversation deletes its cache on the SSD (the chat worker does it).
    full_history = _conversation(conversation_id).token_ids
    fp = model_fingerprint(tiny_base_model, settings.data_dir / "chat" / "versions" /
                           f"v{job_id}", torch.float32)

    def kept() -> bool:  # the worker stores a turn's cache right after the reply is done
        with KVStore(settings.chat_cache_dir, fp, cap_bytes=1 << 30) as store:
            return store.match(full_history) == len(full_history)

    wait_for(kept, 30, "the whole conversation's cache on the SSD")
    with local_client(create_app(), role=None,
                      headers=signed_in_headers("member")) as client:  # the test's member
        r = client.post(f"/chat/{conversation_id}/delete", follow_redirects=False)
    assert r.status_code == 303 and _conversation(conversation_id) is None

    def gone() -> bool:
        with KVStore(settings.chat_cache_dir, fp, cap_bytes=1 << 30) as store:
            return store.match(full_history) == 0

    wait_for(gone, 30, "the deleted conversation's cache to go")


def test_compare_with_and_without_documents_in_the_browser(live_server, chat_worker,
                                                          chromium_path, tiny_base_model,
                                                          tmp_path):
    """The compare form: the version with the documents beside the version alone; the
    documents side names its source, linked to the document's preview."""
    from app.contract.documents import text_file
    from app.models import DocStatus, Document

    project_id, job_id = _version(tiny_base_model, tmp_path)
    settings.documents_dir.mkdir(parents=True, exist_ok=True)
    with session_scope() as session:
        doc = Document(project_id=project_id, original_name="leave policy.txt",
                       stored_name=f"{job_id}-leave.txt", kind="txt", size_bytes=60,
                       sha256=f"{job_id:064d}", status=DocStatus.extracted, word_count=12,
                       preview="Annual leave is 25 days a year.")
        session.add(doc)
        session.flush()
        doc_id = doc.id
    text_file(settings.documents_dir, f"{job_id}-leave.txt").write_text(
        "Annual leave is 25 days a year, booked in the HR portal.", encoding="utf-8")
    with sync_playwright() as pw:
        browser, page, errors = _member_page(pw, chromium_path, live_server)
        page.set_default_timeout(60_000)
        page.goto(f"{live_server}/projects/{project_id}/chat")
        page.click("text=Compare two models")
        page.select_option("#compare-a", str(job_id))
        page.select_option("#compare-b", str(job_id))
        page.check("input[name=b_documents]")
        page.fill("#compare-question", QUESTION)
        page.click(".chat-compare-box button[type=submit]")
        page.wait_for_url("**/chat/compare/*")
        expect(page.locator(".msg-done")).to_have_count(2, timeout=120_000)
        sides = page.locator(".compare-side")
        assert "+ your documents" in sides.nth(1).locator("h2").inner_text()
        assert sides.nth(0).locator(".msg-sources").count() == 0
        link = sides.nth(1).locator(".msg-sources a")
        assert link.inner_text() == "leave policy.txt"
        link.click()
        page.wait_for_url(f"**/projects/{project_id}#preview-{doc_id}")
        browser.close()
    assert errors == []


def _wait_done(conversation_id: int, n: int) -> list[ChatMessage]:
    def done():
        replies = _replies(conversation_id)
        return len(replies) == n and all(r.state == "done" for r in replies) and replies
    return wait_for(done, 120, f"{n} answers in conversation {conversation_id}")


def test_a_saved_context_starts_new_chats_with_the_document_already_read(
        chat_worker, tiny_base_model, tmp_path):
    """Read a document once, save the conversation, start two chats from it: each first
    question restores the whole document's turn from the SSD instead of prefilling it."""
    from app.contract.documents import text_file
    from app.models import DocStatus, Document

    project_id, job_id = _version(tiny_base_model, tmp_path)
    settings.documents_dir.mkdir(parents=True, exist_ok=True)
    body = " ".join(f"Rule {i}: expenses over {i * 10} euros need a receipt." for i in range(60))
    with session_scope() as session:
        doc = Document(project_id=project_id, original_name="expenses.txt",
                       stored_name=f"{job_id}-expenses.txt", kind="txt", size_bytes=len(body),
                       sha256=f"{job_id + 1:064d}", status=DocStatus.extracted)
        session.add(doc)
        session.flush()
        doc_id = doc.id
    text_file(settings.documents_dir, f"{job_id}-expenses.txt").write_text(body)
    with local_client(create_app(), role=None, headers=signed_in_headers("member")) as client:
        r = client.post(f"/projects/{project_id}/chat/read",
                        data={"model": str(job_id), "document_id": str(doc_id)},
                        follow_redirects=False)
        reading = int(r.headers["location"].rsplit("/", 1)[1])
        _wait_done(reading, 1)
        read_ids = _conversation(reading).token_ids
        assert len(read_ids) > 600  # the document is in the model's history
        assert client.post(f"/chat/{reading}/save", data={"name": "Expenses"}).status_code == 200
        page = client.get(f"/projects/{project_id}/chat").text
        assert "Expenses" in page and f'action="/chat/{reading}/start"' in page
        for question in ("Which expenses need a receipt?", "And under 10 euros?"):
            r = client.post(f"/chat/{reading}/start", follow_redirects=False)
            copy = int(r.headers["location"].rsplit("/", 1)[1])
            assert _conversation(copy).token_ids == read_ids
            client.post(f"/chat/{copy}/messages", data={"question": question})
            _, answer = _wait_done(copy, 2)
            # Nothing read again; the second chat restores a few ids more, which the first
            # chat's question shares with its own (the chat template's "<|im_start|>user").
            assert answer.stats["restored_tokens"] >= len(read_ids)
            assert answer.stats["prompt_tokens"] - answer.stats["restored_tokens"] < 30
