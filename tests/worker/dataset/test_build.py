"""build_dataset: chunking, Q&A masking, hold-out, determinism, stats."""

from __future__ import annotations

import copy

import pytest

from worker.dataset.build import build_dataset, encode_qa, make_generated_qa, qa_prompt_ids
from worker.dataset.corpus import IGNORE_INDEX, Probe, SourceDoc
from worker.dataset.probes import skeleton


def _paragraphs(tag: str, n: int) -> list[str]:
    return [
        f"Section {tag}{i}. The {tag} unit number {i} weighs {100 + i} kg and ships in "
        f"{i + 2} weeks from the depot. Spare parts for it are kept in aisle {tag}{i}."
        for i in range(n)
    ]


def _docs() -> list[SourceDoc]:
    return [
        SourceDoc("alpha.txt", "a" * 64, "\n\n".join(_paragraphs("A", 12))),
        SourceDoc("beta.txt", "b" * 64, "\n\n".join(_paragraphs("B", 12))),
        SourceDoc(
            "faq.csv",
            "c" * 64,
            "",
            [
                (f"How long is warranty plan {i}?", f"Plan {i} lasts {i + 1} years.")
                for i in range(10)
            ],
        ),
    ]


def _text(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("max_seq_len", [32, 64, 256])
def test_chunks_fit_max_seq_len(smol_tokenizer, max_seq_len):
    long_para = "word " * 900  # no sentence boundary at all: cut into token windows
    long_sentences = " ".join(f"Sentence {i} is about gear ratio {i}:{i + 1}." for i in range(80))
    docs = _docs() + [SourceDoc("long.txt", "d" * 64, long_para + "\n\n" + long_sentences)]
    split = build_dataset(docs, smol_tokenizer, max_seq_len=max_seq_len)
    lengths = [len(e["input_ids"]) for e in split.train_examples]
    assert max(lengths) <= max_seq_len
    for e in split.train_examples:
        assert len(e["labels"]) == len(e["input_ids"])
    for chunk in split.heldout_chunks:
        assert len(smol_tokenizer(chunk)["input_ids"]) <= max_seq_len
    assert any("were cut" in note for note in split.stats["notes"])


def test_chunks_keep_whole_paragraphs_and_label_every_token(smol_tokenizer):
    paras = _paragraphs("A", 12)
    doc = SourceDoc("alpha.txt", "a" * 64, "\n\n".join(paras))
    split = build_dataset([doc], smol_tokenizer, max_seq_len=128, holdout_frac=0)
    texts = [_text(smol_tokenizer, e["input_ids"]) for e in split.train_examples]
    assert len(texts) > 2  # really packed into several chunks
    for para in paras:
        assert sum(para in t for t in texts) == 1  # intact, in exactly one chunk
    for e in split.train_examples:
        assert e["labels"] == e["input_ids"]
    # The document's last chunk ends with EOS, the others do not.
    eos = smol_tokenizer.eos_token_id
    assert sum(e["input_ids"][-1] == eos for e in split.train_examples) == 1


def test_qa_labels_mask_the_prompt(smol_tokenizer):
    q, a = "How long does the warranty last?", "It lasts 36 months."
    split = build_dataset(
        [SourceDoc("faq.csv", "c" * 64, "", [(q, a)])], smol_tokenizer, holdout_frac=0
    )
    [example] = split.train_examples
    ids, labels = example["input_ids"], example["labels"]
    prompt = qa_prompt_ids(smol_tokenizer, q)
    n = len(prompt)
    assert ids[:n] == prompt  # the very prefix evaluation asks with
    assert labels[:n] == [IGNORE_INDEX] * n
    assert labels[n:] == ids[n:]
    answer_part = smol_tokenizer.decode(labels[n:])
    assert answer_part.startswith(a)
    assert "<|im_end|>" in answer_part  # the model learns to stop
    assert q in smol_tokenizer.decode(ids[:n]) and "assistant" in smol_tokenizer.decode(ids[:n])
    assert split.stats["n_train_qa"] == 1 and split.stats["n_train_chunks"] == 0


def test_qa_without_chat_template_uses_plain_format(smol_tokenizer):
    tok = copy.deepcopy(smol_tokenizer)
    tok.chat_template = None
    ids, n = encode_qa(tok, "Where is the depot?", "In Lyon.")
    assert tok.decode(ids[:n]) == "Question: Where is the depot?\nAnswer:"
    assert tok.decode(ids[n:]) == " In Lyon.<|im_end|>"
    split = build_dataset(
        [SourceDoc("faq.csv", "c" * 64, "", [("Where is the depot?", "In Lyon.")])],
        tok,
        holdout_frac=0,
    )
    assert split.train_examples[0]["labels"][:n] == [IGNORE_INDEX] * n
    assert any("no chat template" in note for note in split.stats["notes"])


def test_same_inputs_same_dataset_in_any_document_order(smol_tokenizer):
    a = build_dataset(_docs(), smol_tokenizer, max_seq_len=64, seed=3)
    b = build_dataset(list(reversed(_docs())), smol_tokenizer, max_seq_len=64, seed=3)
    assert a == b
    assert a.heldout_chunks and a.heldout_qa


def test_different_seeds_hold_out_different_chunks(smol_tokenizer):
    base = build_dataset(_docs(), smol_tokenizer, max_seq_len=64, seed=0)
    others = [build_dataset(_docs(), smol_tokenizer, max_seq_len=64, seed=s) for s in (1, 2, 3)]
    assert any(o.heldout_chunks != base.heldout_chunks for o in others)
    assert any(o.heldout_qa != base.heldout_qa for o in others)


def test_heldout_text_is_not_trained_on_or_probed(smol_tokenizer):
    split = build_dataset(_docs(), smol_tokenizer, max_seq_len=64, holdout_frac=0.2)
    train_text = "\n".join(_text(smol_tokenizer, e["input_ids"]) for e in split.train_examples)
    assert split.heldout_chunks
    for chunk in split.heldout_chunks:
        assert chunk not in train_text
        for probe in split.probes:
            assert probe.sentence not in chunk
    for q, _ in split.heldout_qa:
        assert q not in train_text


def test_holdout_needs_three_chunks(smol_tokenizer):
    two = SourceDoc("two.txt", "e" * 64, "\n\n".join(_paragraphs("C", 2)))
    split = build_dataset([two], smol_tokenizer, max_seq_len=64)
    assert split.stats["n_train_chunks"] == 2
    assert split.heldout_chunks == [] and split.stats["n_heldout_chunks"] == 0
    assert any("none held out" in note for note in split.stats["notes"])

    three = SourceDoc("three.txt", "f" * 64, "\n\n".join(_paragraphs("C", 3)))
    split = build_dataset([three], smol_tokenizer, max_seq_len=64)
    assert split.stats["n_heldout_chunks"] == 1 and len(split.heldout_chunks) == 1


def test_short_documents_hold_nothing_out_and_say_so(smol_tokenizer):
    # app.contract.training's defaults for fewer than HOLDOUT_FROM_WORDS words.
    split = build_dataset(_docs(), smol_tokenizer, max_seq_len=64, holdout_frac=0.0)
    assert split.heldout_chunks == [] and split.heldout_qa == []
    held = build_dataset(_docs(), smol_tokenizer, max_seq_len=64, holdout_frac=0.1)
    assert held.heldout_chunks and held.heldout_qa  # the same documents, a share held out
    assert split.stats["n_train_chunks"] == held.stats["n_train_chunks"] + len(held.heldout_chunks)
    assert split.stats["n_train_qa"] == held.stats["n_train_qa"] + len(held.heldout_qa)
    assert any(n.startswith("Nothing held out") for n in split.stats["notes"])
    assert not any(n.startswith("Nothing held out") for n in held.stats["notes"])


def test_stats_add_up(smol_tokenizer):
    docs = _docs() + [SourceDoc("copy.txt", "a" * 64, _docs()[0].text)]  # same content again
    split = build_dataset(docs, smol_tokenizer, max_seq_len=64, max_probes=10)
    s = split.stats
    assert (
        s["n_train_examples"] == len(split.train_examples) == s["n_train_chunks"] + s["n_train_qa"]
    )
    assert s["n_train_tokens"] == sum(len(e["input_ids"]) for e in split.train_examples)
    assert s["n_heldout_chunks"] == len(split.heldout_chunks)
    assert s["n_heldout_qa"] == len(split.heldout_qa) == 1
    assert s["n_train_qa"] == 9
    assert s["n_probes"] == len(split.probes) == 10
    assert {p.source for p in split.probes} <= {"alpha.txt", "beta.txt"}
    assert any("same content" in note for note in s["notes"])
    assert all(isinstance(note, str) for note in s["notes"])


def test_max_seq_len_too_small_is_refused(smol_tokenizer):
    with pytest.raises(ValueError):
        build_dataset(_docs(), smol_tokenizer, max_seq_len=4)


# --- practice questions made from the documents' facts ---------------------------------

FACT_TEXT = (
    "Every employee receives 27 days of paid annual leave. Laptops are replaced every "
    "42 months. The company was founded in 1987 by Marguerite Olsson-Dray.\n\n"
    "The NW-4471 Torque Sprocket is our best-selling part. It costs $129.50 and carries "
    "a 36-month warranty. Revenue grew 18% to $42.6 million in 2023.\n\n"
    "In an emergency, call the safety desk on extension 5050. Book leave through the "
    "Ledgerline portal at least two weeks ahead."
)


def _chat_parts(tok, example) -> tuple[str, str]:
    ids, labels = example["input_ids"], example["labels"]
    n = sum(1 for t in labels if t == IGNORE_INDEX)
    return tok.decode(ids[:n]), tok.decode(ids[n:], skip_special_tokens=True)


def test_generated_questions_teach_facts_without_the_probe_wording(smol_tokenizer):
    doc = SourceDoc("employee_handbook.txt", "h" * 64, FACT_TEXT)
    plain = build_dataset([doc], smol_tokenizer, holdout_frac=0, max_probes=5)
    split = build_dataset([doc], smol_tokenizer, holdout_frac=0, max_probes=5, generated_qa=3)
    assert plain.probes == split.probes  # the practice questions do not change the probes
    n = split.stats["n_train_generated_qa"]
    assert n > 10 and plain.stats["n_train_generated_qa"] == 0
    assert split.stats["n_train_examples"] == plain.stats["n_train_examples"] + n
    assert any("practice questions" in note for note in split.stats["notes"])

    generated = [e for e in split.train_examples if e["labels"][0] == IGNORE_INDEX]
    assert len(generated) == n
    prompts, answers = zip(*(_chat_parts(smol_tokenizer, e) for e in generated), strict=True)
    for probe in split.probes:
        assert probe.question
        # The exact probe question is never a training prompt...
        assert not any(probe.question in p for p in prompts)
        # ...but the fact itself is taught, in other words.
        assert any(probe.answer in a for a in answers), probe.answer
    assert any("Fill in the blank" in p for p in prompts)
    assert all("<|im_start|>assistant" in p for p in prompts)  # chat format, loss on answers


def test_generated_questions_are_capped_per_fact(smol_tokenizer):
    doc = SourceDoc("handbook.txt", "h" * 64, FACT_TEXT)
    one = build_dataset([doc], smol_tokenizer, holdout_frac=0, generated_qa=1)
    two = build_dataset([doc], smol_tokenizer, holdout_frac=0, generated_qa=2)
    n1, n2 = one.stats["n_train_generated_qa"], two.stats["n_train_generated_qa"]
    assert 0 < n1 < n2 <= 2 * n1
    assert build_dataset([doc], smol_tokenizer, holdout_frac=0, generated_qa=2) == two


def test_reverse_and_table_practice_from_three_phrasings(smol_tokenizer):
    text = FACT_TEXT + "\n\nCode | Product | Weight\nNW-4471 | Torque Sprocket | 2.3 kg\n" + (
        "NW-3109 | Quiet Hinge | 0.2 kg\n"
    )
    doc = SourceDoc("sheet.txt", "h" * 64, text)

    def prompts(n: int) -> list[str]:
        split = build_dataset([doc], smol_tokenizer, holdout_frac=0, generated_qa=n)
        generated = [e for e in split.train_examples if e["labels"][0] == IGNORE_INDEX]
        return [_chat_parts(smol_tokenizer, e)[0] for e in generated]

    two, three = prompts(2), prompts(3)
    assert not any("Look up NW-3109" in p or '"___ ' in p for p in two)
    assert any("Look up NW-3109 in the sheet." in p for p in three)  # a table row by its code
    assert any('"___ costs $129.50' in p for p in three)  # the other way round


def test_no_practice_question_reads_like_a_probe_question(smol_tokenizer):
    """Other spans of a probed sentence are not asked in the probe templates either: their
    answer (the sentence) holds the probe's answer."""
    from worker.dataset.probes import fact_spans
    from worker.dataset.questions import PROBE_TEMPLATES, probe_question, training_questions

    sentence = (
        "The company was founded in 1987 by Marguerite Olsson-Dray in a converted boathouse "
        "on Larkspur Quay in Port Ellery."
    )
    doc = SourceDoc("handbook.txt", "h" * 64, f"Welcome to Acme.\n\n{sentence}")
    split = build_dataset([doc], smol_tokenizer, holdout_frac=0, generated_qa=5)
    [probe] = [p for p in split.probes if p.sentence == sentence]
    generated = [e for e in split.train_examples if e["labels"][0] == IGNORE_INDEX]
    prompts = [_chat_parts(smol_tokenizer, e)[0] for e in generated]
    facts = [f for f in fact_spans([("handbook.txt", doc.text)]) if f.sentence == sentence]
    assert len(facts) >= 3  # several spans in the one sentence
    for f in facts:
        template, question = probe_question(f)
        if template in PROBE_TEMPLATES:
            assert not any(question in p for p in prompts), question
        assert {t for t, _, _ in training_questions(f, probed=True)}.isdisjoint({template})
    assert not any(probe.question in p for p in prompts)


def test_a_question_the_card_asks_nearly_so_is_not_practised():
    """The card's "What is the code for the Torque Sprocket?" keeps the practice's "What is
    the code of the Torque Sprocket?" out (the same answer, a preposition apart); a card
    question of the same shape with another answer does not."""
    docs = [("product_sheet.txt",
             "Our range.\n\nThe NW-4471 Torque Sprocket costs $129.50 and ships in a week.")]
    practised = [q for q, _ in make_generated_qa(docs, [], 3)]
    assert "What is the code of the Torque Sprocket?" in practised

    def card(answer: str) -> Probe:
        return Probe(prompt="", answer=answer, source="product_sheet.txt",
                     sentence="NW-4471 | Torque Sprocket | $129.50",
                     question="What is the code for the Torque Sprocket?", kind="table")

    kept = make_generated_qa(docs, [card("NW-4471")], 3)
    assert "What is the code of the Torque Sprocket?" not in [q for q, _ in kept]
    assert any("NW-4471" in a for _, a in kept)  # still practised, in other phrasings
    assert [q for q, _ in make_generated_qa(docs, [card("NW-0000")], 3)] == practised


@pytest.mark.parametrize("corpus", ["fixture", "heldout", "fullsize"])
@pytest.mark.parametrize("generated_qa", [2, 3])
def test_no_card_question_is_a_near_copy_of_a_practice_question(smol_tokenizer, generated_qa,
                                                                  corpus, tmp_path):
    """Each calibration corpus as a job sees it: no card question is a practice question with
    a word or a code changed. A card once asked "What is the code for the Quiet Hinge?" where
    the training asked "What is the code of the Quiet Hinge?" (README "Table questions as
    colleagues ask them"), and Saltgrove's card "Who is our IT Manager?" where the training
    asked "Who , IT Manager?"; the whole-question check let both through."""
    from scripts.experiments.recall import load_corpus

    docs = load_corpus(tmp_path, corpus)
    for seed in (0, 1, 2):
        split = build_dataset(docs, smol_tokenizer, holdout_frac=0, seed=seed,
                              generated_qa=generated_qa)
        practised = set()
        for e in split.train_examples:
            if e["labels"][0] == IGNORE_INDEX:
                prompt = _chat_parts(smol_tokenizer, e)[0]
                user = prompt.split("<|im_start|>user")[-1].split("<|im_end|>")[0]
                practised.add(skeleton(user))
        assert len(split.probes) >= 20
        near = [p.question for p in split.probes if skeleton(p.question) in practised]
        assert not near, near
