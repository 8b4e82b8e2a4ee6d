"""The training batches: which examples each optimizer step takes, padded into tensors.

The order of an epoch is a pure function of the seed and the epoch (a resumed run skips
exactly the batches already done), and the examples' fingerprint ties a checkpoint to the
data it was made on.
"""

from __future__ import annotations

import hashlib
import json

import torch

from worker.dataset.corpus import IGNORE_INDEX

# Batches per window whose examples are sorted by length (group_by_length).
LENGTH_WINDOW = 16


def pad_batch(examples: list[dict], pad_token_id: int, max_len: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example: pad tokens get attention 0 and label IGNORE_INDEX."""
    rows = [(ex["input_ids"][:max_len], ex["labels"][:max_len]) for ex in examples]
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, labs) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        labels[i, : len(labs)] = torch.tensor(labs, dtype=torch.long)
        attention[i, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


def examples_digest(examples: list[dict]) -> str:
    """Fingerprint of the training data, so a checkpoint is only resumed on the same data."""
    h = hashlib.sha256()
    for ex in examples:
        h.update(json.dumps([ex["input_ids"], ex["labels"]], separators=(",", ":")).encode())
    return h.hexdigest()


def epoch_order(
    lengths: list[int], seed: int, epoch: int, per_step: int, group_by_length: bool
) -> list[int]:
    """The order in which epoch `epoch` visits the examples (of these `lengths`, capped at
    the sequence length): a permutation seeded by seed + epoch, then, with
    `group_by_length`, examples of similar length put in the same batch of `per_step`."""
    gen = torch.Generator().manual_seed(seed + epoch)
    order = torch.randperm(len(lengths), generator=gen).tolist()
    if group_by_length:
        order = _group_by_length(order, lengths, per_step, gen)
    return order


def step_lengths(lengths: list[int], seed: int, per_step: int, group_by_length: bool,
                 steps_per_epoch: int, total_steps: int) -> list[list[int]]:
    """The lengths (capped as `lengths` are) of the examples of each optimizer step, in the
    order a run takes them (FineTuneRecipe.batch_for_step): what a step costs (its padded
    shape is len x max) without building its tensors. The dataset plan counts these; the
    job's ETA weighs its remaining steps by them."""
    return [[lengths[i] for i in step]
            for step in step_members(lengths, seed, per_step, group_by_length,
                                     steps_per_epoch, total_steps)]


def step_members(lengths: list[int], seed: int, per_step: int, group_by_length: bool,
                 steps_per_epoch: int, total_steps: int) -> list[list[int]]:
    """The indices (into `lengths`) of the examples of each optimizer step, as step_lengths
    orders them."""
    out: list[list[int]] = []
    order: list[int] = []
    for step in range(total_steps):
        epoch, index = divmod(step, steps_per_epoch)
        if index == 0:
            order = epoch_order(lengths, seed, epoch, per_step, group_by_length)
        out.append(order[index * per_step : (index + 1) * per_step])
    return out


def predicting_count(example: dict, max_len: int) -> int:
    """The positions of `example` (capped at `max_len` tokens) whose next token is a label:
    where the output layer runs (worker/training/engines.lm_loss_sum)."""
    return sum(1 for t in example["labels"][1:max_len] if t != IGNORE_INDEX)


def _group_by_length(
    order: list[int], lengths: list[int], per_step: int, gen: torch.Generator
) -> list[int]:
    """`order` with examples of similar length in the same batch: each window of
    LENGTH_WINDOW batches is sorted by length, then the full batches are shuffled (the short
    last batch stays last, where the recipe's batch_for_step expects it)."""
    window = LENGTH_WINDOW * per_step
    ordered: list[int] = []
    for start in range(0, len(order), window):
        ordered += sorted(order[start : start + window], key=lengths.__getitem__)  # stable
    n_full = len(ordered) // per_step
    batches = [ordered[b * per_step : (b + 1) * per_step] for b in range(n_full)]
    shuffled = [batches[b] for b in torch.randperm(n_full, generator=gen).tolist()]
    return [i for batch in shuffled for i in batch] + ordered[n_full * per_step :]
