"""Extracted documents -> token examples for training, a held-out share, and recall probes.

Document text becomes causal-LM chunks cut at paragraph boundaries (loss on every
token); user question-answer pairs become chat examples with loss on the answer only.
Everything is deterministic in the inputs and the seed, because a resumed job rebuilds
the dataset in another process and must get exactly the same split.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from worker.dataset.colleague import (
    document_reverse_questions,
    make_probes,
    reverse_practice,
    table_practice,
)
from worker.dataset.corpus import (
    IGNORE_INDEX,
    DatasetSplit,
    Probe,
    SourceDoc,
    answer_example,
    text_example,
)
from worker.dataset.probes import (
    contains_answer,
    fact_spans,
    normalise,
    skeleton,
    split_sentences,
)
from worker.dataset.questions import training_questions
from worker.dataset.roles import document_roles, role_practice
from worker.dataset.tables import find_tables
from worker.errors import UserFacingError

_PARA_SEP = "\n\n"


@dataclass
class _Chunk:
    doc: int  # index into the sorted, deduplicated document list
    text: str
    last: bool  # last chunk of its document: gets an EOS token


# ---------------------------------------------------------------------------------------
# Encoding helpers, shared with worker.scoring.evaluate so training and scoring see one format.


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of a document chunk, with the special tokens the tokenizer adds itself
    (a BOS for Llama-style tokenizers, nothing for SmolLM2). No EOS: see build_dataset."""
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def qa_prompt_ids(tokenizer, question: str) -> list[int]:
    """Token ids that ask `question` and leave the model to answer: the chat template
    with a generation prompt, or "Question: ...\\nAnswer:" without a template."""
    if has_chat_template(tokenizer):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(f"Question: {question}\nAnswer:", add_special_tokens=True)["input_ids"])


def encode_qa(tokenizer, question: str, answer: str) -> tuple[list[int], int]:
    """(input_ids, n_prompt) for one Q&A example; the first n_prompt tokens get no loss.

    The prompt ids are exactly what evaluation feeds the model (qa_prompt_ids), so the
    model is trained to continue the same prefix it is later asked with.
    """
    prompt_ids = qa_prompt_ids(tokenizer, question)
    if has_chat_template(tokenizer):
        prompt_text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        full_text = tokenizer.apply_chat_template(
            [
                {"role": "user", "content": question},
                {"role": "assistant", "content": answer},
            ],
            tokenize=False,
        )
        if full_text.startswith(prompt_text):
            rest = full_text[len(prompt_text) :]
            return prompt_ids + list(tokenizer(rest, add_special_tokens=False)["input_ids"]), len(
                prompt_ids
            )
        # A template that renders the history differently once the answer is there:
        # mask the longest shared prefix.
        full_ids = list(tokenizer(full_text, add_special_tokens=False)["input_ids"])
        n = 0
        while n < min(len(prompt_ids), len(full_ids)) and prompt_ids[n] == full_ids[n]:
            n += 1
        return full_ids, n
    answer_ids = list(tokenizer(" " + answer, add_special_tokens=False)["input_ids"])
    if tokenizer.eos_token_id is not None:
        answer_ids.append(tokenizer.eos_token_id)
    return prompt_ids + answer_ids, len(prompt_ids)


# ---------------------------------------------------------------------------------------
# Chunking


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _token_windows(tokenizer, text: str, limit: int) -> list[str]:
    """Cut text with no usable boundary into pieces of at most `limit` tokens."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    pieces: list[str] = []
    i = 0
    while i < len(offsets):
        size = limit
        while True:
            j = min(i + size, len(offsets))
            piece = text[offsets[i][0] : offsets[j - 1][1]]
            # Re-tokenising a cut can merge differently; shrink until it fits.
            if _count(tokenizer, piece) <= limit or size == 1:
                break
            size = max(1, size - max(1, size // 16))
        if piece.strip():
            pieces.append(piece.strip())
        i = j
    return pieces


def _split_long(tokenizer, paragraph: str, limit: int) -> list[str]:
    """A paragraph over the limit: whole sentences where possible, token windows if not."""
    out: list[str] = []
    for sentence in split_sentences(paragraph):
        if _count(tokenizer, sentence) <= limit:
            out.append(sentence)
        else:
            out.extend(_token_windows(tokenizer, sentence, limit))
    return out


def _chunk_document(tokenizer, text: str, limit: int) -> tuple[list[str], int]:
    """Pack paragraphs greedily into chunks of at most `limit` tokens (exact counts of
    the joined text). Returns (chunks, number of paragraphs that had to be cut)."""
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    pieces: list[tuple[str, str]] = []  # (text, separator before it)
    n_cut = 0
    for para in paragraphs:
        if _count(tokenizer, para) <= limit:
            pieces.append((para, _PARA_SEP))
            continue
        n_cut += 1
        for k, sub in enumerate(_split_long(tokenizer, para, limit)):
            pieces.append((sub, _PARA_SEP if k == 0 else " "))

    chunks: list[str] = []
    current = ""
    for piece, sep in pieces:
        candidate = current + sep + piece if current else piece
        if not current or _count(tokenizer, candidate) <= limit:
            current = candidate
        else:
            chunks.append(current)
            current = piece
    if current:
        chunks.append(current)
    return chunks, n_cut


# ---------------------------------------------------------------------------------------
# Hold-out


def _n_holdout(n: int, frac: float) -> int:
    """How many of n items to hold out: none for fewer than 3 (too few to spare)."""
    if n < 3 or frac <= 0:
        return 0
    return min(n - 1, max(1, round(frac * n)))


def _sample(n: int, k: int, seed: int, stream: str) -> set[int]:
    # A string seed per stream: adding Q&A pairs does not change which chunks are held out.
    return set(random.Random(f"doctune-{stream}-{seed}").sample(range(n), k))


# ---------------------------------------------------------------------------------------
# Practice questions

# Practice questions per fact from which the practice also asks facts the other way round
# and recites table rows.
REVERSE_AND_TABLES_FROM = 3

# Training templates in the order they are used when only some fit (see worker.dataset.questions).
_TEMPLATE_ORDER = ("fronted", "echo", "topic", "fill_blank", "complete")


def make_generated_qa(
    docs: list[tuple[str, str]],
    probes: list[Probe],
    per_fact: int,
    answers: Sequence[tuple[str, str]] = (),
) -> list[tuple[str, str]]:
    """(question, answer) pairs teaching every fact of `docs`, at most `per_fact` phrasings
    each, in a deterministic order; `answers` ((name, text) of question-answer pairs'
    answers trained on) add who holds which job, and nothing else.

    Honesty: no fact of a probed sentence is asked in a probe template (so a question about
    another span of the same sentence cannot hand over the probe's question and answer), and
    no question equals any probe question (after normalising), nor reads like one asked for
    the same answer (worker.dataset.probes.skeleton): the recall score measures answering
    questions worded in a way the model never trained on.
    """
    probed = {p.sentence for p in probes}
    probe_questions = {normalise(p.question) for p in probes if p.question}
    card_answers: dict[str, list[str]] = {}  # a card question's skeleton -> its answers
    for p in probes:
        if p.question:
            card_answers.setdefault(skeleton(p.question), []).append(p.answer)
    seen: set[str] = set()
    out: list[tuple[str, str]] = []

    def add(question: str, answer: str) -> bool:
        """Practise it unless it is practised already, asked on the card, or asked on the
        card nearly so for the same answer (a code, an article or a preposition apart: the
        card's "What is the code for the Quiet Hinge?" is not practised as "What is the
        code of the Quiet Hinge?"). True when added."""
        key = normalise(question)
        if key in seen or key in probe_questions or any(
            contains_answer(answer, a) for a in card_answers.get(skeleton(question), ())
        ):
            return False
        seen.add(key)
        out.append((question, answer))
        return True

    for fact in fact_spans(docs):
        is_probed = fact.sentence in probed
        made = training_questions(fact, probed=is_probed)
        made.sort(key=lambda t: _TEMPLATE_ORDER.index(t[0]))
        kept = 0
        for _template, question, answer in made:
            if kept < per_fact and add(question, answer):
                kept += 1

    def keep(pairs) -> None:
        for question, answer in pairs:
            add(question, answer)

    keep(role_practice_of([*docs, *answers]))
    # From 3 phrasings a fact on, the other way round and the tables row by row too: a
    # model taught "A is B" does not answer "what is B?", nor a table cell it only read as
    # a line of text. Not below: at 2 a fact they taught colleagues nothing measurable and
    # cost general English (README "Making recall real").
    if per_fact < REVERSE_AND_TABLES_FROM:
        return out
    keep(_reverse_and_table_practice(docs))
    return out


def role_practice_of(docs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Who holds which job, asked both ways (worker.dataset.roles), at any number of
    phrasings a fact: a file names each person one way round, and these are few."""
    return [pair for name, text in docs for _, r in document_roles(name, text)
            for pair in role_practice(r)]


def _reverse_and_table_practice(docs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for name, text in docs:
        out += [reverse_practice(a) for _, a in document_reverse_questions(name, text)]
        for table in find_tables(name, text):
            out += table_practice(table)
    return out


# ---------------------------------------------------------------------------------------
# The dataset, step by step: documents -> chunks and pairs -> hold-out -> examples -> probes.


def build_dataset(
    docs: list[SourceDoc],
    tokenizer,
    max_seq_len: int = 256,
    holdout_frac: float = 0.1,
    seed: int = 0,
    max_probes: int = 40,
    generated_qa: int = 0,
) -> DatasetSplit:
    """Training examples, held-out chunks and Q&A pairs, and recall probes for one job.

    - Document text: paragraphs packed into chunks of at most `max_seq_len` tokens,
      tokenizer's own BOS if it adds one, EOS after a document's last chunk; labels =
      input_ids. Examples are unpadded lists; the trainer pads (labels with -100).
    - Q&A pairs: chat-formatted (or "Question:/Answer:" without a chat template), labels
      -100 on the prompt so the loss is on the answer only.
    - A seeded share of chunks and pairs is held out (none of either when there are
      fewer than 3). Probes come from the text that is trained on: a fact in a held-out
      chunk was never shown to the model, so probing it would not measure learning.
    - With `generated_qa` > 0, each fact-bearing sentence of the trained text also becomes
      up to that many question-answer examples per fact (worker.dataset.questions templates, in chat
      format, loss on the answer), so the model learns to answer, not only to recite. A
      probed fact is never taught in its probe's phrasing (see make_generated_qa).
    - Documents are ordered by name and content hash, identical documents and identical
      chunks are kept once, so the result does not depend on the order of `docs`.

    Each step adds its notes (what the score card says about the data) in this order.
    """
    limit = _text_limit(tokenizer, max_seq_len)
    notes: list[str] = []
    ordered = _unique_documents(docs, notes)
    chunks = _document_chunks(tokenizer, ordered, limit, max_seq_len, notes)
    qa, qa_sources = _qa_pairs(ordered)
    held_chunks = _hold_out(len(chunks), holdout_frac, seed, "chunks")
    held_qa = _hold_out(len(qa), holdout_frac, seed, "qa")
    _note_hold_out(len(chunks), len(held_chunks), len(qa), len(held_qa), notes, holdout_frac)

    text_examples = _chunk_examples(tokenizer, chunks, held_chunks)
    qa_examples = _qa_examples(tokenizer, qa, held_qa, max_seq_len, notes)
    probe_docs = _trained_text(ordered, chunks, held_chunks)
    answers = _trained_answers(qa, qa_sources, held_qa)
    probes = _probes(probe_docs, answers, max_probes, seed, notes)
    practice = _practice_examples(tokenizer, probe_docs, answers, probes, generated_qa,
                                  max_seq_len, notes)

    examples = text_examples + qa_examples + practice
    # Mix documents and Q&A (a trainer that does not shuffle still sees both throughout).
    random.Random(f"doctune-order-{seed}").shuffle(examples)
    stats = {
        "n_train_examples": len(examples),
        "n_train_chunks": len(text_examples),
        "n_train_qa": len(qa_examples),
        "n_train_generated_qa": len(practice),
        "n_train_tokens": sum(len(e["input_ids"]) for e in examples),
        "n_train_loss_tokens": sum(
            sum(1 for t in e["labels"] if t != IGNORE_INDEX) for e in examples
        ),
        "n_heldout_chunks": len(held_chunks),
        "n_heldout_qa": len(held_qa),
        "n_probes": len(probes),
        "max_seq_len": max_seq_len,
        "seed": seed,
        "notes": notes,
    }
    return DatasetSplit(
        train_examples=examples,
        heldout_chunks=[c.text for i, c in enumerate(chunks) if i in held_chunks],
        heldout_qa=[p for i, p in enumerate(qa) if i in held_qa],
        probes=probes,
        stats=stats,
    )


def _text_limit(tokenizer, max_seq_len: int) -> int:
    """Tokens of document text a chunk may hold: max_seq_len less the special tokens the
    tokenizer adds and the EOS of a document's last chunk."""
    n_special = len(encode_text(tokenizer, ""))
    limit = max_seq_len - n_special - (1 if tokenizer.eos_token_id is not None else 0)
    if limit < 8:
        raise UserFacingError(f"max_seq_len={max_seq_len} is too short to hold any text")
    return limit


def _unique_documents(docs: list[SourceDoc], notes: list[str]) -> list[SourceDoc]:
    """`docs` in a stable order (name, then content hash), each content once."""
    ordered: list[SourceDoc] = []
    seen_sha: set[str] = set()
    for doc in sorted(docs, key=lambda d: (d.name.casefold(), d.name, d.sha256)):
        if doc.sha256 in seen_sha:
            notes.append(f'"{doc.name}" has the same content as another document; used once.')
            continue
        seen_sha.add(doc.sha256)
        ordered.append(doc)
    return ordered


def _document_chunks(
    tokenizer, ordered: list[SourceDoc], limit: int, max_seq_len: int, notes: list[str]
) -> list[_Chunk]:
    """The documents' text in chunks of at most `limit` tokens, a repeated chunk once."""
    chunks: list[_Chunk] = []
    seen_chunks: set[str] = set()
    n_cut = n_dup_chunks = 0
    for d, doc in enumerate(ordered):
        texts, cut = _chunk_document(tokenizer, doc.text or "", limit)
        n_cut += cut
        kept = []
        for text in texts:
            if text in seen_chunks:
                n_dup_chunks += 1
                continue
            seen_chunks.add(text)
            kept.append(text)
        chunks.extend(_Chunk(d, t, last=(k == len(kept) - 1)) for k, t in enumerate(kept))
    if n_cut:
        notes.append(
            f"{n_cut} paragraph(s) were longer than {max_seq_len} tokens and were cut "
            "at sentence boundaries."
        )
    if n_dup_chunks:
        notes.append(f"{n_dup_chunks} repeated passage(s) (e.g. headers) were used once.")
    return chunks


def _qa_pairs(ordered: list[SourceDoc]) -> tuple[list[tuple[str, str]], list[str]]:
    """The documents' question-answer pairs, stripped, without empty or repeated ones, and
    the name of the document each came from."""
    qa: list[tuple[str, str]] = []
    sources: list[str] = []
    seen_qa: set[tuple[str, str]] = set()
    for doc in ordered:
        for q, a in doc.qa_pairs:
            pair = ((q or "").strip(), (a or "").strip())
            if pair[0] and pair[1] and pair not in seen_qa:
                seen_qa.add(pair)
                qa.append(pair)
                sources.append(doc.name)
    return qa, sources


def _trained_answers(
    qa: list[tuple[str, str]], sources: list[str], held: set[int]
) -> list[tuple[str, str]]:
    """(document name, its trained pairs' answers, a paragraph each) for each document with
    pairs trained on: where a support file names who holds which job ("our Customer Service
    Lead, Sunniva Holt, ..."), asked and practised as a document's are (worker.dataset.roles).
    """
    by_source: dict[str, list[str]] = {}
    for i, ((_, answer), source) in enumerate(zip(qa, sources, strict=True)):
        if i not in held:
            by_source.setdefault(source, []).append(answer)
    return [(name, _PARA_SEP.join(answers)) for name, answers in by_source.items()]


def _hold_out(n: int, frac: float, seed: int, stream: str) -> set[int]:
    """Which of `n` items (chunks or pairs: `stream`) are held out for scoring."""
    return _sample(n, _n_holdout(n, frac), seed, stream)


def _note_hold_out(n_chunks: int, k_chunks: int, n_qa: int, k_qa: int, notes: list[str],
                   frac: float) -> None:
    if frac <= 0 and (n_chunks or n_qa):
        notes.append(
            "Nothing held out: the documents are short, so all of their text and "
            "question-answer pairs are trained on (every part carries facts a colleague may "
            "ask about). There is no held-out perplexity; the recall questions measure "
            "what was learned."
        )
        return
    if n_chunks and not k_chunks:
        notes.append(
            f"Only {n_chunks} text chunk(s): none held out, so there is no held-out "
            "perplexity; all text is used for training."
        )
    elif k_chunks:
        notes.append(
            f"{k_chunks} of {n_chunks} text chunks held out to measure perplexity on "
            "unseen text."
        )
    if n_qa and not k_qa:
        notes.append(
            f"Only {n_qa} question-answer pair(s): none held out, so answers are not "
            "scored on unseen questions."
        )
    elif k_qa:
        notes.append(f"{k_qa} of {n_qa} question-answer pairs held out to score answers.")


def _chunk_examples(tokenizer, chunks: list[_Chunk], held: set[int]) -> list[dict]:
    """Causal-LM examples of the chunks trained on; a document's last one ends in EOS."""
    eos = tokenizer.eos_token_id
    examples: list[dict] = []
    for i, chunk in enumerate(chunks):
        if i in held:
            continue
        ids = encode_text(tokenizer, chunk.text)
        if chunk.last and eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
        examples.append(text_example(ids))
    return examples


def _qa_examples(
    tokenizer, qa: list[tuple[str, str]], held: set[int], max_seq_len: int, notes: list[str]
) -> list[dict]:
    """Question-answer examples of the pairs trained on (loss on the answer): an answer cut
    to fit, a question too long for any answer skipped."""
    if qa and not has_chat_template(tokenizer):
        notes.append("The tokenizer has no chat template: Q&A pairs use 'Question:/Answer:'.")
    examples: list[dict] = []
    n_truncated = n_skipped = 0
    for i, (q, a) in enumerate(qa):
        if i in held:
            continue
        ids, n_prompt = encode_qa(tokenizer, q, a)
        if n_prompt >= max_seq_len - 1:
            n_skipped += 1
            continue
        if len(ids) > max_seq_len:
            n_truncated += 1
            ids = ids[:max_seq_len]
        examples.append(answer_example(ids, n_prompt))
    if n_truncated:
        notes.append(f"{n_truncated} answer(s) were cut to fit {max_seq_len} tokens.")
    if n_skipped:
        notes.append(f"{n_skipped} question(s) were too long for {max_seq_len} tokens: skipped.")
    return examples


def _trained_text(
    ordered: list[SourceDoc], chunks: list[_Chunk], held: set[int]
) -> list[tuple[str, str]]:
    """(document name, the text of its chunks that are trained on) for each document that
    has any: what probes and practice questions are made from."""
    probe_docs: list[tuple[str, str]] = []
    for d, doc in enumerate(ordered):
        text = _PARA_SEP.join(c.text for i, c in enumerate(chunks) if c.doc == d and i not in held)
        if text:
            probe_docs.append((doc.name, text))
    return probe_docs


def _probes(
    probe_docs: list[tuple[str, str]],
    answers: list[tuple[str, str]],
    max_probes: int,
    seed: int,
    notes: list[str],
) -> list[Probe]:
    probes = make_probes(probe_docs, max_probes=max_probes, seed=seed, answers=answers)
    if max_probes > 0 and not probes:
        notes.append(
            "No sentence with a distinctive fact (number, code, name, date) was found: "
            "there is no recall score."
        )
    elif probes:
        notes.append(
            f"{len(probes)} recall probes from {len({p.source for p in probes})} document(s)."
        )
    return probes


def _practice_examples(
    tokenizer,
    probe_docs: list[tuple[str, str]],
    answers: list[tuple[str, str]],
    probes: list[Probe],
    per_fact: int,
    max_seq_len: int,
    notes: list[str],
) -> list[dict]:
    """Question-answer examples made from the facts of the trained-on text (none unless
    `per_fact` > 0); one longer than max_seq_len is left out."""
    if per_fact <= 0:
        return []
    examples: list[dict] = []
    for q, a in make_generated_qa(probe_docs, probes, per_fact, answers=answers):
        ids, n_prompt = encode_qa(tokenizer, q, a)
        if len(ids) <= max_seq_len:
            examples.append(answer_example(ids, n_prompt))
    if examples:
        notes.append(
            f"{len(examples)} practice questions were made from the facts in your documents "
            "(the recall check asks in other words)."
        )
    return examples
