"""Replay against the base model's whole next-token distribution, not its greedy answer (an
experiment: `--recipes default+soft_replay=true`).

Replay (worker/training/replay.py) trains on the base model's own greedy answers with
cross-entropy, which pulls every answer position towards one token: the base model's most
likely, which sharpens the distribution the forgetting check reads (training the same answers
as plain text made it worse, README *Earlier*). Here a replayed answer's loss is instead the
cross-entropy against the base model's distribution at each position (its TOP_K likeliest
tokens, renormalised): a KL penalty to the base model on the replayed text, as Learning
without Forgetting (Li & Hoiem 2016) and RLHF's KL term use, up to a constant. Everything
else about training is the recipe's own.

The base model's distribution of each replayed example is read once, before training
(`base_targets`), so it serves LoRA and full fine-tuning alike. The same loss takes per-token
weights for the other rows (scripts/experiments/fact_weight.py), so the two combine.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

TOP_K = 256  # base-model tokens kept per position (the rest of its mass is under 1e-3 here)


@torch.no_grad()
def base_targets(model, replayed: list[dict]) -> dict[tuple, tuple[torch.Tensor, torch.Tensor]]:
    """For each replayed example (by its token ids): the base model's TOP_K likeliest next
    tokens and their probabilities (renormalised) at each position that predicts a label.
    `model` must be the base model (before training; a fresh LoRA adapter is the same)."""
    from worker.training import engines

    was_training = model.training
    model.eval()
    targets = {}
    for ex in replayed:
        ids = torch.tensor([ex["input_ids"]])
        keep = engines.predicting(torch.tensor([ex["labels"]]))
        logits = model(input_ids=ids, logits_to_keep=keep).logits.float()
        probs, top = torch.softmax(logits, dim=-1).topk(min(TOP_K, logits.size(-1)), dim=-1)
        targets[tuple(ex["input_ids"])] = (top, probs / probs.sum(-1, keepdim=True))
    if was_training:
        model.train()
    return targets


@contextlib.contextmanager
def soft_replay(targets: dict[tuple, tuple[torch.Tensor, torch.Tensor]],
                weights: dict[tuple, torch.Tensor] | None = None):
    """worker.training.engines.lm_loss_sum with the rows that are replayed examples (keys
    of `targets`, base_targets') scored against the base model's distribution: the
    cross-entropy to it, which is the KL divergence from it plus a constant; other rows by
    their labels, as before, each label's cross-entropy times its weight where `weights`
    (by the row's token ids: a weight per label the row predicts, in order) names the row."""
    from worker.training import engines

    saved = engines.lm_loss_sum
    weights = weights or {}

    def loss_sum(model, batch):
        ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
        rows = [tuple(ids[r, : int(mask[r].sum())].tolist()) for r in range(ids.size(0))]
        if not any(key in targets or key in weights for key in rows):
            return saved(model, batch)
        keep = engines.predicting(labels)
        logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=keep).logits.float()
        log_probs = F.log_softmax(logits, dim=-1)
        hard = labels[:, 1:][keep[:, :-1]]
        total = logits.new_zeros(())
        at = 0
        for r, key in enumerate(rows):
            n = int(keep[r].sum())
            if key in targets:
                top, probs = targets[key]
                total = total - (probs * log_probs[at : at + n].gather(-1, top)).sum()
            else:
                nll = F.nll_loss(log_probs[at : at + n], hard[at : at + n], reduction="none")
                total = total + (nll * weights[key] if key in weights else nll).sum()
            at += n
        return total

    engines.lm_loss_sum = loss_sum
    try:
        yield
    finally:
        engines.lm_loss_sum = saved


@torch.no_grad()
def plain_samples(model, tokenizer, n: int, tokens: int = 128, seed: int = 0) -> list[list[int]]:
    """`n` passages of plain text the base model writes on its own (sampled at temperature 1
    from the document separator, as its pretraining text began; seeded): text from its own
    distribution, not its greedy answers, to replay as text (`plain_replay=N`)."""
    start = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    if start is None or start == tokenizer.unk_token_id:
        start = tokenizer.eos_token_id
    gen = torch.Generator().manual_seed(seed)
    out = []
    was_training = model.training
    model.eval()
    for _ in range(n):
        ids = torch.tensor([[start]])
        past = None
        step_ids = ids
        for _ in range(tokens):
            result = model(input_ids=step_ids, past_key_values=past, use_cache=True)
            past = result.past_key_values
            probs = torch.softmax(result.logits[0, -1].float(), dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen)
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            step_ids = nxt.view(1, 1)
        out.append(ids[0].tolist())
    if was_training:
        model.train()
    return out
