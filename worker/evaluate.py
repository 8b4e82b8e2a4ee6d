"""The quality score: held-out perplexity, knowledge recall on probes, Q&A answers.

Run once on the base model and once on the tuned one with the same DatasetSplit, so the
two scores are comparable. Greedy decoding everywhere: the score is reproducible.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter

import torch
import torch.nn.functional as F

from worker.corpus import DatasetSplit
from worker.dataset import encode_text, qa_prompt_ids
from worker.probes import contains_answer

# Upper bound on tokens per perplexity forward pass: the float32 logits of one pass
# take tokens x vocab x 4 bytes (4096 x 49152 x 4 = 0.8 GB for SmolLM2).
_PPL_TOKENS_PER_BATCH = 4096


# ---------------------------------------------------------------------------------------
# Answer metrics (small on purpose: a later change may swap in a library metric).


def squad_normalise(text: str) -> str:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD-style token F1 between a model answer and the reference answer."""
    pred = squad_normalise(prediction).split()
    ref = squad_normalise(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = Counter(pred) & Counter(ref)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred), overlap / len(ref)
    return 2 * precision * recall / (precision + recall)


def score_answer(output: str, answer: str) -> dict:
    """Per-answer scores: token F1 and whether the answer appears in the output."""
    return {"f1": token_f1(output, answer), "contains": contains_answer(output, answer)}


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


@torch.no_grad()
def generate(
    model, tokenizer, prompts: list[list[int]], max_new_tokens: int = 24, batch_size: int = 8
) -> list[str]:
    """Greedy continuations of tokenised prompts, decoded without special tokens.

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
    for name in ("temperature", "top_p", "top_k", "min_p", "typical_p"):
        setattr(gen_config, name, None)  # sampling settings only trigger warnings here
    outputs: list[str] = [""] * len(prompts)
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
        for r, i in enumerate(rows):
            outputs[i] = tokenizer.decode(out[r, width:].tolist(), skip_special_tokens=True)
    return outputs


# ---------------------------------------------------------------------------------------


def evaluate(
    model, tokenizer, split: DatasetSplit, max_new_tokens: int = 24, batch_size: int = 8
) -> dict:
    """Score `model` on a DatasetSplit; a JSON-serialisable dict: perplexity, recall with
    per-probe outputs, and held-out Q&A F1 / containment with per-question outputs.

    Works with plain transformers models and peft-wrapped ones; the model is put in eval
    mode and put back in training mode afterwards if it was training.
    """
    was_training = model.training
    model.eval()
    try:
        ppl = perplexity(model, tokenizer, split.heldout_chunks, batch_size=batch_size)

        probe_prompts = [encode_text(tokenizer, p.prompt) for p in split.probes]
        probe_outputs = generate(model, tokenizer, probe_prompts, max_new_tokens, batch_size)
        probes = [
            {
                "prompt": p.prompt,
                "answer": p.answer,
                "output": out,
                "hit": contains_answer(out, p.answer),
                "source": p.source,
            }
            for p, out in zip(split.probes, probe_outputs, strict=True)
        ]
        n_recalled = sum(p["hit"] for p in probes)

        qa_prompts = [qa_prompt_ids(tokenizer, q) for q, _ in split.heldout_qa]
        qa_outputs = generate(model, tokenizer, qa_prompts, max_new_tokens, batch_size)
        items = []
        for (q, a), out in zip(split.heldout_qa, qa_outputs, strict=True):
            items.append({"question": q, "answer": a, "output": out, **score_answer(out, a)})
    finally:
        if was_training:
            model.train()

    n_qa = len(items)
    return {
        "perplexity": ppl,
        "n_heldout_chunks": len(split.heldout_chunks),
        "recall": n_recalled / len(probes) if probes else None,
        "n_probes": len(probes),
        "n_recalled": n_recalled,
        "probes": probes,
        "qa": {
            "n": n_qa,
            "f1": sum(i["f1"] for i in items) / n_qa if n_qa else None,
            "exact": sum(i["contains"] for i in items) / n_qa if n_qa else None,
            "items": items,
        },
    }
