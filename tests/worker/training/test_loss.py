"""The training loss runs the output layer only where the next token is a label
(worker/training/engines.lm_loss_sum) and gives the loss and gradients of the whole-sequence
computation; the in-memory reference steps with torch's fused AdamW on the CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from tests.worker.conftest_training import tiny_model_dir
from worker.dataset.corpus import IGNORE_INDEX
from worker.training.batches import pad_batch, predicting_count
from worker.training.engines import InMemoryEngine, _keeps_logits, lm_loss_sum, token_loss_sum

PAD = 2


@pytest.fixture(scope="module")
def base(tmp_path_factory, smol_tokenizer):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir(tmp_path_factory, smol_tokenizer))


def _answer_batch() -> dict[str, torch.Tensor]:
    """Three chat-like rows of different lengths, loss on their last few tokens only."""
    gen = torch.Generator().manual_seed(1)
    rows = []
    for length, prompt in ((30, 22), (24, 20), (17, 9)):
        ids = torch.randint(10, 200, (length,), generator=gen).tolist()
        rows.append({"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:]})
    return pad_batch(rows, PAD, 64)


def _whole_sequence_loss(model, batch) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return token_loss_sum(logits, batch["labels"])


def _grads(model, loss_fn, batch) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss), grads


@pytest.mark.parametrize("method", ["full", "lora"])
def test_the_kept_positions_give_the_whole_sequences_loss_and_gradients(base, method):
    model = copy.deepcopy(base)
    if method == "lora":
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        for n, p in model.named_parameters():  # some gradient to compare from the start
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.02)
    if not _keeps_logits(model):
        pytest.skip("this transformers release cannot slice the logits by a mask")
    batch = _answer_batch()
    rows_seen: list[int] = []
    head = model.get_output_embeddings()
    hook = head.register_forward_hook(lambda m, i, o: rows_seen.append(i[0].shape[:-1].numel()))
    try:
        kept_loss, kept = _grads(model, lm_loss_sum, batch)
        whole_loss, whole = _grads(model, _whole_sequence_loss, batch)
    finally:
        hook.remove()
    predicting = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    # The output layer ran at the 8 + 4 + 8 predicting positions, then at all 3 x 30.
    assert rows_seen == [predicting, batch["input_ids"].numel()] and predicting == 20
    assert kept_loss == pytest.approx(whole_loss, rel=1e-5)
    assert kept.keys() == whole.keys() and kept
    for name, grad in whole.items():
        torch.testing.assert_close(kept[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_model_without_logits_to_keep_computes_every_position(base):
    class Plain(torch.nn.Module):  # a forward that takes no logits_to_keep
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask)

    model = Plain(copy.deepcopy(base))
    batch = _answer_batch()
    assert float(lm_loss_sum(model, batch)) == pytest.approx(
        float(_whole_sequence_loss(model, batch)), rel=1e-6
    )


def test_a_release_that_cannot_slice_by_mask_computes_every_position(base, monkeypatch):
    """transformers 5.17 (the GPU machine's) sliced `hidden[:, logits_to_keep, :]`, which
    raises an IndexError for a (rows, positions) mask after the whole forward."""
    import sys

    module = sys.modules[type(base).__module__]

    def old_slice(hidden, keep):
        return hidden[:, slice(-keep, None) if isinstance(keep, int) else keep, :]

    # (a release without the helper slices inline: the same IndexError)
    monkeypatch.setattr(module, "slice_logits_to_keep", old_slice, raising=False)
    model = copy.deepcopy(base)
    batch = _answer_batch()
    assert not _keeps_logits(model)
    assert float(lm_loss_sum(model, batch)) == pytest.approx(
        float(_whole_sequence_loss(model, batch)), rel=1e-6
    )


def test_predicting_counts_the_positions_before_a_label_within_the_cap():
    example = {"input_ids": list(range(10)), "labels": [IGNORE_INDEX] * 6 + [6, 7, 8, 9]}
    assert predicting_count(example, 256) == 4  # positions 5..8 predict tokens 6..9
    assert predicting_count(example, 8) == 2  # capped at 8 tokens: 6 and 7 are left
    text = {"input_ids": list(range(10)), "labels": list(range(10))}
    assert predicting_count(text, 256) == 9  # every position but the last


def test_the_in_memory_engine_steps_with_fused_adamw_on_the_cpu(base):
    engine = InMemoryEngine(copy.deepcopy(base), learning_rate=1e-3, total_steps=2)
    assert engine.optimizer.defaults["fused"] is True
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    engine.step(_answer_batch())
    changed = [n for n, p in engine.model.named_parameters() if not torch.equal(p, before[n])]
    assert changed
