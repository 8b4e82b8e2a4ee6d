"""The quality score: knowledge recall (facts asked as questions in chat, and as sentence
completions), held-out perplexity, the user's own Q&A, and a forgetting check.

Run once on the base model and once on the tuned one with the same DatasetSplit, so the
two scores are comparable. Greedy decoding everywhere: the score is reproducible.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from worker.dataset.build import encode_text, qa_prompt_ids
from worker.dataset.corpus import DatasetSplit, Probe
from worker.dataset.probes import gives_answer

# The forgetting check's sample: plain general English written for DocTune (not from any
# data set), so a rise in its perplexity means the model got worse at ordinary text.
GENERAL_TEXT = Path(__file__).parent / "data" / "general_text.txt"

# Upper bound on tokens per perplexity forward pass: the float32 logits of one pass
# take tokens x vocab x 4 bytes (4096 x 49152 x 4 = 0.8 GB for SmolLM2).
_PPL_TOKENS_PER_BATCH = 4096


# ---------------------------------------------------------------------------------------
# Answer metrics


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD token F1 between a model answer and the reference answer (0..1), computed by
    torchmetrics' implementation of the official SQuAD script."""
    from torchmetrics.functional.text import squad

    out = squad(
        [{"prediction_text": prediction, "id": "0"}],
        [{"answers": {"answer_start": [0], "text": [reference]}, "id": "0"}],
    )
    return round(float(out["f1"]) / 100, 6)


def score_answer(output: str, answer: str) -> dict:
    """Per-answer scores: token F1 and whether the output gives the answer."""
    return {"f1": token_f1(output, answer), "contains": gives_answer(output, answer)}


# ---------------------------------------------------------------------------------------
# Model plumbing


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _pad_id(tokenizer) -> int:
    for tok_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tok_id is not None:
            return int(tok_id)
    return 0


@torch.no_grad()
def perplexity(model, tokenizer, texts: list[str], batch_size: int = 8) -> float | None:
    """exp(mean next-token NLL) over all tokens of `texts` (token-weighted). None if empty."""
    seqs = [ids for ids in (encode_text(tokenizer, t) for t in texts) if len(ids) >= 2]
    if not seqs:
        return None
    device, pad = _device(model), _pad_id(tokenizer)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    total_nll, total_tokens = 0.0, 0
    start = 0
    while start < len(order):
        longest = len(seqs[order[min(start + batch_size, len(order)) - 1]])
        size = max(1, min(batch_size, _PPL_TOKENS_PER_BATCH // longest))
        batch = [seqs[i] for i in order[start : start + size]]
        start += size
        width = max(len(s) for s in batch)
        # Right padding: causal attention never lets a real token see the padding.
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, s in enumerate(batch):
            ids[row, : len(s)] = torch.tensor(s)
            mask[row, : len(s)] = 1
        ids, mask = ids.to(device), mask.to(device)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        targets = ids[:, 1:]
        nll = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        keep = mask[:, 1:].bool()
        total_nll += float(nll[keep].sum())
        total_tokens += int(keep.sum())
    return math.exp(total_nll / total_tokens)


def generate(
    model, tokenizer, prompts: list[list[int]], max_new_tokens: int = 24, batch_size: int = 8
) -> list[str]:
    """Greedy continuations of tokenised prompts, decoded without special tokens (the
    job's scoring: no probabilities kept, so no vocabulary-wide logits per step either)."""
    answers = generate_scored(model, tokenizer, prompts, max_new_tokens, batch_size, probs=False)
    return [a.text for a in answers]


@dataclass(frozen=True)
class Answer:
    text: str
    # The probability the model gave each token it chose, up to (not including) the end of
    # the answer: how sure it was of each piece.
    token_probs: tuple[float, ...]


@torch.no_grad()
def generate_scored(
    model, tokenizer, prompts: list[list[int]], max_new_tokens: int = 24, batch_size: int = 8,
    probs: bool = True,
) -> list[Answer]:
    """Greedy continuations of tokenised prompts, decoded without special tokens, each with
    the probability of every token chosen (none without `probs`).

    Prompts are batched by length and left-padded here (the tokenizer is not touched),
    so each continuation starts right after its own prompt.
    """
    if not prompts:
        return []
    device, pad = _device(model), _pad_id(tokenizer)
    gen_config = model.generation_config.__class__.from_dict(model.generation_config.to_dict())
    gen_config.do_sample = False
    gen_config.max_new_tokens = max_new_tokens
    gen_config.max_length = None
    gen_config.pad_token_id = pad
    gen_config.return_dict_in_generate = True
    gen_config.output_logits = probs  # the raw scores, as the model gave them
    for name in ("temperature", "top_p", "top_k", "min_p", "typical_p"):
        setattr(gen_config, name, None)  # sampling settings only trigger warnings here
    stops = _stop_ids(tokenizer, gen_config)
    outputs: list[Answer] = [Answer("", ())] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        width = max(len(prompts[i]) for i in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):
            p = prompts[i]
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        out = model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gen_config
        )
        chosen = out.sequences[:, width:]
        # (rows, new tokens): the probability of each chosen token under the raw logits
        chances = torch.stack(
            [torch.softmax(step.float(), dim=-1).gather(1, chosen[:, t : t + 1]).squeeze(1)
             for t, step in enumerate(out.logits)], dim=1,
        ).cpu() if probs else None
        for r, i in enumerate(rows):
            tokens = chosen[r].tolist()
            end = next((t for t, tok in enumerate(tokens) if tok in stops), len(tokens))
            outputs[i] = Answer(
                tokenizer.decode(tokens, skip_special_tokens=True),
                tuple(round(float(x), 6) for x in chances[r, :end]) if probs else (),
            )
    return outputs


def _stop_ids(tokenizer, gen_config) -> set[int]:
    """The ids that end an answer: the tokenizer's end of sequence and the model's own."""
    configured = gen_config.eos_token_id
    ids = set(configured) if isinstance(configured, list | tuple) else {configured}
    return {int(i) for i in ids | {tokenizer.eos_token_id} if i is not None}


# ---------------------------------------------------------------------------------------


@cache
def general_text() -> str:
    return GENERAL_TEXT.read_text(encoding="utf-8")


def general_chunks() -> list[str]:
    """The forgetting-check sample, one paragraph per chunk."""
    return [p.strip() for p in general_text().split("\n\n") if p.strip()]


def probe_set_id(probes: list[Probe]) -> str:
    """A fingerprint of a probe set: two jobs with the same one were asked the same things."""
    key = sorted([p.prompt, p.answer, p.question] for p in probes)
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


def evaluate(
    model,
    tokenizer,
    split: DatasetSplit,
    max_new_tokens: int = 24,
    batch_size: int = 8,
    answer_tokens: int = 48,
    general: bool = True,
) -> dict:
    """Score `model` on a DatasetSplit; a JSON-serialisable dict (one side of Job.scores):

    - perplexity: on the held-out chunks (None without any);
    - recall / n_probes / n_recalled / probes: the probes as sentence completions (the
      model reads the text before the fact and continues it, `max_new_tokens`);
    - questions: the same facts asked as questions in the chat format, in phrasings kept
      out of training (`answer_tokens` to answer); {n, n_recalled, recall, items};
    - qa: the user's held-out question-answer pairs, token F1 and containment;
    - general: the forgetting check, perplexity on a general-English sample shipped with
      the app (skipped with general=False);
    - probe_set: fingerprint of the probes, so two jobs can be compared on the same ones.

    Works with plain transformers models and peft-wrapped ones; the model is put in eval
    mode and put back in training mode afterwards if it was training.
    """
    was_training = model.training
    model.eval()
    try:
        ppl = perplexity(model, tokenizer, split.heldout_chunks, batch_size=batch_size)
        general_ppl = (
            perplexity(model, tokenizer, general_chunks(), batch_size=batch_size)
            if general
            else None
        )
        probes = _completions(model, tokenizer, split.probes, max_new_tokens, batch_size)
        questions = _questions(model, tokenizer, split.probes, answer_tokens, batch_size)
        items = _user_answers(model, tokenizer, split.heldout_qa, max_new_tokens, batch_size)
    finally:
        if was_training:
            model.train()

    n_recalled = sum(p["hit"] for p in probes)
    n_q_hit = sum(q["hit"] for q in questions)
    n_qa = len(items)
    return {
        "probe_set": probe_set_id(split.probes),
        "perplexity": ppl,
        "n_heldout_chunks": len(split.heldout_chunks),
        "recall": n_recalled / len(probes) if probes else None,
        "n_probes": len(probes),
        "n_recalled": n_recalled,
        "probes": probes,
        "questions": {
            "n": len(questions),
            "n_recalled": n_q_hit,
            "recall": n_q_hit / len(questions) if questions else None,
            "items": questions,
        },
        "general": {"perplexity": general_ppl, "n_paragraphs": len(general_chunks())}
        if general
        else None,
        "qa": {
            "n": n_qa,
            "f1": sum(i["f1"] for i in items) / n_qa if n_qa else None,
            "exact": sum(i["contains"] for i in items) / n_qa if n_qa else None,
            "items": items,
        },
    }


def _completions(model, tokenizer, probes: list[Probe], max_new_tokens: int, batch_size: int
                 ) -> list[dict]:
    """The probes as sentence completions: the text before each fact, continued (those
    that have one: a question asked the other way round or from a table has none)."""
    probes = [p for p in probes if p.prompt]
    prompts = [encode_text(tokenizer, p.prompt) for p in probes]
    outputs = generate(model, tokenizer, prompts, max_new_tokens, batch_size)
    return [
        {
            "prompt": p.prompt,
            "answer": p.answer,
            "output": out,
            "hit": gives_answer(out, p.answer),
            "source": p.source,
        }
        for p, out in zip(probes, outputs, strict=True)
    ]


def _questions(model, tokenizer, probes: list[Probe], answer_tokens: int, batch_size: int
               ) -> list[dict]:
    """The probes' facts asked as questions in chat (those that have a question)."""
    asked = [p for p in probes if p.question]
    outputs = generate(
        model,
        tokenizer,
        [qa_prompt_ids(tokenizer, p.question) for p in asked],
        answer_tokens,
        batch_size,
    )
    return [
        {
            "question": p.question,
            "answer": p.answer,
            "output": out,
            "hit": gives_answer(out, p.answer),
            "source": p.source,
            "sentence": p.sentence,
            "template": p.template,
            "kind": p.kind,
        }
        for p, out in zip(asked, outputs, strict=True)
    ]


def _user_answers(model, tokenizer, pairs: list[tuple[str, str]], max_new_tokens: int,
                  batch_size: int) -> list[dict]:
    """The user's held-out question-answer pairs, answered and scored."""
    prompts = [qa_prompt_ids(tokenizer, q) for q, _ in pairs]
    outputs = generate(model, tokenizer, prompts, max_new_tokens, batch_size)
    return [
        {"question": q, "answer": a, "output": out, **score_answer(out, a)}
        for (q, a), out in zip(pairs, outputs, strict=True)
    ]
