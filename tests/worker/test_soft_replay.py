"""The recall experiment's soft replay (scripts/experiments/soft_replay.py): a replayed row is
scored against the base model's distribution, every other row by its labels as before."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model

from scripts.experiments import soft_replay as soft
from tests.worker.models import tiny_llama
from worker.dataset.corpus import answer_example
from worker.training import engines
from worker.training.batches import pad_batch


def _lora(tokenizer):
    model = tiny_llama(tokenizer, seed=0, tie_word_embeddings=False)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    return get_peft_model(model, config)


def _examples():
    torch.manual_seed(0)
    replayed = answer_example(torch.randint(5, 400, (12,)).tolist(), 5)
    other = answer_example(torch.randint(5, 400, (9,)).tolist(), 3)
    return replayed, other


def _b_grads(model) -> float:
    return sum(float(p.grad.abs().sum()) for n, p in model.named_parameters()
               if "lora_B" in n and p.grad is not None)


def test_other_rows_keep_their_loss_and_the_replayed_row_pulls_to_the_base(
        smol_tokenizer, monkeypatch):
    monkeypatch.setattr(soft, "TOP_K", len(smol_tokenizer))  # the whole distribution
    model = _lora(smol_tokenizer)
    replayed, other = _examples()
    batch = pad_batch([replayed, other], smol_tokenizer.eos_token_id or 0, 64)
    alone = pad_batch([other], smol_tokenizer.eos_token_id or 0, 64)

    # A fresh adapter (B = 0) is the base model: the replayed row is already where the soft
    # target wants it, so only the other row's labels move B; with hard labels both do.
    hard = engines.lm_loss_sum(model, batch)
    hard.backward()
    hard_grads = _b_grads(model)
    model.zero_grad()
    engines.lm_loss_sum(model, alone).backward()
    other_grads = _b_grads(model)
    model.zero_grad()
    targets = soft.base_targets(model, [replayed])
    assert len(targets) == 1
    with soft.soft_replay(targets):
        loss = engines.lm_loss_sum(model, batch)
        loss.backward()
    assert torch.isclose(torch.tensor(_b_grads(model)), torch.tensor(other_grads), rtol=1e-4)
    assert hard_grads > other_grads * 1.05

    # Its loss is the other row's cross-entropy plus the base distribution's own entropy at
    # the replayed answer's positions.
    with torch.no_grad():
        keep = engines.predicting(batch["labels"])[:1]
        logits = model(input_ids=batch["input_ids"][:1], attention_mask=batch["attention_mask"][:1],
                       logits_to_keep=keep).logits.float()
        p = torch.softmax(logits, -1)
        entropy = -(p * p.log()).sum()
        expected = engines.lm_loss_sum(model, alone) + entropy
    assert torch.isclose(loss.detach(), expected, rtol=1e-4)
    assert engines.lm_loss_sum is not None and engines.lm_loss_sum.__name__ == "lm_loss_sum"


def test_plain_samples_are_seeded_passages_of_the_asked_length(smol_tokenizer):
    model = tiny_llama(smol_tokenizer, seed=0)
    first = soft.plain_samples(model, smol_tokenizer, 2, tokens=6, seed=3)
    assert first == soft.plain_samples(model, smol_tokenizer, 2, tokens=6, seed=3)
    assert [len(ids) for ids in first] == [7, 7] and first[0] != first[1]
    assert first != soft.plain_samples(model, smol_tokenizer, 2, tokens=6, seed=4)
