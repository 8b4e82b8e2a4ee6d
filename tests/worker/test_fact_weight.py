"""The recall experiment's fact weighting (scripts/experiments/fact_weight.py): the loss of a
row is moved onto the tokens of the facts it states, its total weight unchanged."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from scripts.experiments import fact_weight as fw
from scripts.experiments.soft_replay import soft_replay
from tests.worker.models import tiny_llama
from worker.dataset.build import encode_qa
from worker.dataset.corpus import answer_example
from worker.training import engines
from worker.training.batches import pad_batch


def _marked(tokenizer, labels, weights) -> str:
    predicted = [t for t in labels[1:] if t != -100]
    heavy = max(weights)
    return "".join(f"[{tokenizer.decode([t])}]" if w == heavy else tokenizer.decode([t])
                   for t, w in zip(predicted, weights, strict=True))


def test_the_facts_tokens_carry_the_weight_and_the_row_keeps_its_mass(smol_tokenizer):
    ids, n_prompt = encode_qa(smol_tokenizer, "What does the Quiet Hinge cost?",
                              "The Quiet Hinge costs $18.75 and ships in 3 days.")
    labels = answer_example(ids, n_prompt)["labels"]
    # "3" stands alone as a word here; "18" inside "$18.75" is no fact of its own
    weights = fw.label_weights(smol_tokenizer, labels, ["$18.75", "3 days", "18"], 4.0)
    n = sum(1 for t in labels[1:] if t != -100)
    assert len(weights) == n and abs(sum(weights) - n) < 1e-6
    marked = _marked(smol_tokenizer, labels, weights)
    assert "[$][1][8][.][7][5]" in marked.replace(" ", "")
    assert "[3][days]" in marked.replace(" ", "")
    assert "Quiet" in marked and "[ Quiet]" not in marked and "[ costs]" not in marked
    assert max(weights) / min(weights) == 4.0

    # no fact among its labels, or nothing but a fact: the row is left as it is
    none = fw.label_weights(smol_tokenizer, labels, ["Lantern Room"], 4.0)
    assert none == [1.0] * n
    examples = [answer_example(ids, n_prompt)]
    assert fw.fact_weights(smol_tokenizer, examples, ["Lantern Room"], 4.0) == {}
    got = fw.fact_weights(smol_tokenizer, examples, ["$18.75"], 4.0)
    assert list(got) == [tuple(ids)] and len(got[tuple(ids)]) == n


def test_a_weighted_row_is_scored_by_its_weights_and_the_others_as_before(smol_tokenizer):
    model = tiny_llama(smol_tokenizer, seed=0)
    torch.manual_seed(0)
    weighted = answer_example(torch.randint(5, 400, (12,)).tolist(), 5)
    other = answer_example(torch.randint(5, 400, (9,)).tolist(), 3)
    pad = smol_tokenizer.eos_token_id or 0
    batch = pad_batch([weighted, other], pad, 64)
    w = torch.tensor([3.0, 0.5, 0.5, 1.0, 0.5, 0.5, 1.0])  # the 7 labels the first row predicts
    with torch.no_grad():
        plain = engines.lm_loss_sum(model, batch)
        with soft_replay({}, {tuple(weighted["input_ids"]): w}):
            moved = engines.lm_loss_sum(model, batch)
        with soft_replay({}, {tuple(weighted["input_ids"]): torch.ones(7)}):
            ones = engines.lm_loss_sum(model, batch)
        alone = pad_batch([weighted], pad, 64)
        keep = engines.predicting(alone["labels"])
        logits = model(input_ids=alone["input_ids"], logits_to_keep=keep).logits.float()
        nll = F.cross_entropy(logits, alone["labels"][:, 1:][keep[:, :-1]], reduction="none")
        expected = plain - nll.sum() + (nll * w).sum()
    assert torch.isclose(ones, plain, rtol=1e-5)
    assert torch.isclose(moved, expected, rtol=1e-5)
    assert not torch.isclose(moved, plain, rtol=1e-3)
