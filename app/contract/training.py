"""Training settings both sides read: the methods, the Train form's Advanced fields with
their bounds (the web form checks them, the worker's recipe enforces them again), and the
defaults chosen for the corpus size (what the Train button uses unless the user opens
"Advanced"). Pure Python, so the web app can show them and the worker can use them without
either importing the other's heavy side."""

from __future__ import annotations

import math
from dataclasses import dataclass

METHODS = ("lora", "full")


@dataclass(frozen=True)
class FormField:
    """One setting of the Advanced form: its name in the form and in the job's params."""

    name: str
    label: str
    hint: str  # what it does, in words (the form adds the bounds)
    whole: bool  # a whole number (else any number)
    low: float
    high: float


FIELDS = (
    FormField("epochs", "Epochs", "How many times training reads all your documents", True, 1, 50),
    FormField(
        "learning_rate",
        "Learning rate",
        "How big each learning step is; too high can make the model forget",
        False,
        1e-6,
        1e-2,
    ),
    FormField(
        "lora_rank",
        "LoRA rank",
        "Size of the LoRA add-on; higher can hold more (LoRA only)",
        True,
        1,
        256,
    ),
    FormField(
        "max_seq_len",
        "Max sequence length",
        "Tokens the model reads at once; longer needs more memory",
        True,
        32,
        4096,
    ),
)
FIELD_NAMES = tuple(f.name for f in FIELDS)
# name -> (low, high): the bounds the form accepts and the recipe enforces.
LIMITS = {f.name: (f.low, f.high) for f in FIELDS}

# Which of a block's projections a LoRA job adapts (the `lora_modules` setting): every one
# unless a job says otherwise. A job that continues an earlier version keeps the projections
# that version's adapter has (worker.training.continued.adapter_settings).
LORA_MODULES: dict[str, tuple[str, ...]] = {
    "all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
}


# The recipe measured on the fixture corpus (README "Making recall real", reproduced by
# `python -m scripts.experiments.recall`): practice questions made from the facts, a
# LoRA step large enough to learn them in a few epochs, and the base model's own answers to
# everyday requests replayed alongside.
GENERATED_QA = 2  # practice questions per fact-bearing sentence (worker.dataset)
REPLAY = 16  # everyday requests the base model answers once, trained on too (worker.training.replay)
# Below this many words of text no document text is held out for the held-out perplexity
# (nor question-answer pairs for their score): on a short set every chunk carries facts a
# colleague asks about (the recall experiment, fixture corpus: one held-out chunk of about
# ten took the answers to 1, 5, 6 or 8 of its 60 colleague questions out of training,
# depending on the seed), and a perplexity over one or two chunks says little.
HOLDOUT_FROM_WORDS = 5_000
HOLDOUT_FRAC = 0.1  # the share held out above it (worker.dataset.build)
# From this size (words, and 30 a question-answer pair) the default reads the documents
# twice: three passes of a corpus this size would take about 10 minutes on 2 cores.
TWO_PASSES_FROM = 2_500
# LoRA's step. Read twice (from TWO_PASSES_FROM), a fact is learned at twice the step, about
# as hard as in 3 or 4 passes at 1e-3: at the size (tests/fixtures/fullsize_docs.py)
# 14, 15 and 16 of 84 colleague questions right against 9, 10 and 10 (seeds 0-2), general
# perplexity 18-20% above the base model's against 3-9% (README "What the practice reaches").
LORA_LR = 1e-3
LORA_LR_TWO_PASSES = 2e-3
CHECKPOINT_EVERY = 25  # optimizer steps between a job's checkpoints (also at every epoch end)


def is_checkpoint_step(step: int, total_steps: int, steps_per_epoch: int,
                       every: int = CHECKPOINT_EVERY) -> bool:
    """Whether a job writes a checkpoint after optimizer step `step` (counted from 1): every
    `every` steps, at each epoch's end and at the last step (worker.training.recipe)."""
    return step % every == 0 or step % max(1, steps_per_epoch) == 0 or step == total_steps


def checkpoints_after(step: int, total_steps: int, steps_per_epoch: int,
                      every: int = CHECKPOINT_EVERY) -> int:
    """How many checkpoints a job writes after `step` up to the end (the estimate and the
    ETA count their time)."""
    if step >= total_steps:
        return 0
    spe = max(1, steps_per_epoch)

    def multiples(k: int) -> int:  # of k in (step, total_steps]
        return total_steps // k - step // k

    both = every * spe // math.gcd(every, spe)
    count = multiples(every) + multiples(spe) - multiples(both)
    return count + (not (total_steps % every == 0 or total_steps % spe == 0))


def default_params(n_words: int, n_qa: int = 0, method: str = "lora") -> dict:
    """Defaults that finish in minutes on a CPU with the embedded 135M model.

    Small corpora need more passes to be learned at all; large ones fewer, so the
    number of optimizer steps (and the wall time) stays roughly bounded. The practice
    questions multiply the examples (about 8x on the fixture corpus), so the passes are
    fewer than text alone would need. Two passes from 2,500: at the size of a small
    company's office files (tests/fixtures/fullsize_docs.py, 3,456 words) three took 12.4
    minutes of training on a 2-core AMD EPYC, two 8.1, with as many colleague questions
    right within a seed's spread, a card nearer to them and less forgetting (README "At the
    size of a company's files").
    """
    size = n_words + 30 * n_qa  # a Q&A pair is worth about one short paragraph
    if size < 2_000:
        epochs = 4
    elif size < TWO_PASSES_FROM:
        epochs = 3
    else:
        epochs = 2
    return {
        "method": method,
        "epochs": epochs,
        # LoRA adapters tolerate (and on tiny data need) a far larger step than full FT.
        "learning_rate": (LORA_LR_TWO_PASSES if epochs == 2 else LORA_LR) if method == "lora"
        else 2e-5,
        "lora_rank": 16,
        "max_seq_len": 256,
        "generated_qa": GENERATED_QA,
        "replay": REPLAY,
        "holdout_frac": HOLDOUT_FRAC if n_words >= HOLDOUT_FROM_WORDS else 0.0,
    }
