"""The calibration questions asked with the chat's "Use my documents" (app/chat/passages.py):
the best passages of the fixture documents, found by SQLite FTS5 with BM25 as the app finds
them (the same passages, the same tokenizer, the same MATCH expression, the same prompt),
put before each question. Used by scripts/experiments/recall.py (--open-book)."""

from __future__ import annotations

import sqlite3

from app.chat.passages import TOP_K, Found, fts5_query, passages_of, prompt_with


class Library:
    """An in-memory FTS5 index of the documents' passages, like the app's passages_fts."""

    def __init__(self, docs: list, k: int = TOP_K) -> None:
        self.k = k  # passages put before a question (the app's TOP_K)
        self.db = sqlite3.connect(":memory:")
        self.db.execute("CREATE VIRTUAL TABLE p USING fts5(text, name UNINDEXED, "
                        "tokenize='porter unicode61')")
        for doc in docs:
            self.db.executemany("INSERT INTO p(text, name) VALUES (?, ?)",
                                [(body, doc.name) for body in passages_of(doc.text, doc.qa_pairs)])

    def search(self, question: str, k: int | None = None) -> list[Found]:
        query = fts5_query(question)
        if not query:
            return []
        rows = self.db.execute("SELECT rowid, name, text FROM p WHERE p MATCH ? "
                               "ORDER BY bm25(p) LIMIT ?", (query, k or self.k))
        return [Found(rowid, 0, name, text) for rowid, name, text in rows]

    def prompt(self, question: str) -> tuple[str, bool]:
        """(what the model reads, whether any passage was found)."""
        found = self.search(question)
        return prompt_with(question, found), bool(found)


def holds(found: list[Found], answer: str) -> bool:
    """Whether any of the passages found holds `answer` (else the miss is the search's)."""
    from worker.dataset.probes import contains_answer

    return any(contains_answer(f.text, answer) for f in found)


def found_answer(library: Library, question: str, answer: str) -> bool:
    """Whether the passages found for `question` hold `answer`."""
    return holds(library.search(question), answer)


def reading_practice(tokenizer, docs: list, probes: list, k: int, max_len: int) -> list[dict]:
    """Practice in reading (RAFT: Zhang et al. 2024, "Adapting Language Model to Domain
    Specific RAG"): one practice question per fact (the dataset builder's, never a probe's
    phrasing), asked with the `k` passages the search finds for it, answered with the fact;
    loss on the answer. Whether the passages hold the answer is up to the search, as in the
    chat. An example longer than `max_len` tokens is left out."""
    from worker.dataset.build import encode_qa, make_generated_qa
    from worker.dataset.corpus import answer_example

    library = Library(docs, k)
    out = []
    for question, answer in make_generated_qa([(d.name, d.text) for d in docs], probes, 1):
        ids, n_prompt = encode_qa(tokenizer, library.prompt(question)[0], answer)
        if len(ids) <= max_len:
            out.append(answer_example(ids, n_prompt))
    return out
