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
# How many passes the default reads the documents, from the tokens of the training examples
# they make (document text, practice questions, question-answer pairs; not the fixed replay):
# three where that keeps the tokens read under PASS_TOKENS, else two. Set once the job's
# dataset is built (worker.jobs.pipeline.settled_job), since the same words make twice the
# tokens when they are lists and "Label: value" lines (each a fact practised) instead of
# prose: 13,848 from Northwind's 862 words and 15,054 from Cogwell's (three: 44 of 180 and
# 55 of 183 colleague questions over seeds 0-2, where four at 1e-3 answered 45 and 55, in
# three quarters of the steps and with less forgetting), 29,497 from Northwind's and
# Cogwell's files in one project (three: 27 of 121 colleague questions and the card 5 points
# above them, where two answered 7 with the card 19 points above, and four 19 and 17; 11.8
# minutes of training on a 2-core AMD EPYC), 32,902 from Brindle Oakes' 1,621 words of lists
# (two: as many answers as four in half the time), 37,526 from Saltgrove's 3,111 (two).
# README "Three passes for a middle-sized set", "Three passes for the small sets too".
PASS_TOKENS = 90_000
MOST_PASSES = 3
# Before the dataset is built (the Train panel before the worker counted its plan): tokens
# guessed from the words, as the fixture corpora make them (13.7-16.5 tokens a word with the
# practice questions, 11.7 for Saltgrove's longer prose; a question-answer pair about 60).
TRAIN_TOKENS_PER_WORD = 15
TRAIN_TOKENS_PER_QA = 60
# The settings the job's dataset decides unless the user chose them (Job.params["auto"]).
AUTO = "auto"
# LoRA's step. Read twice, a fact is learned at twice the step, about as hard as in 3 or 4
# passes at 1e-3: at the size (tests/fixtures/fullsize_docs.py) 14, 15 and 16 of 84
# colleague questions right against 9, 10 and 10 (seeds 0-2), general perplexity 18-20%
# above the base model's against 3-9% (README "What the practice reaches").
# Three passes take the step between (at 1e-3 they put the card 12-15 points above the
# colleagues on Brindle Oakes and Saltgrove; at 1.5e-3, 5 and 10 on Northwind and Cogwell
# together, seeds 0 and 1, and 3.5 on Brindle Oakes). Four passes or more (the user's
# choice: the default reads at most three) take 1e-3.
LORA_LR = 1e-3
LORA_LR_THREE_PASSES = 1.5e-3
LORA_LR_TWO_PASSES = 2e-3
FULL_LR = 2e-5  # full fine-tuning: one step for any number of passes
# NEFTune (worker.training.noise): noise on the input embeddings while a LoRA job trains, so
# a fact learned from the documents' words is not tied to those exact tokens. Over seeds
# 0-2: Northwind 58 of 180 colleague questions against 44 without it, Saltgrove 52 of 252
# against 45, Cogwell 46 of 183 against 55 (each run within its noise); the card's headline
# within 5.4 points of the colleagues on all nine runs (16.4 under on one without); general
# English no worse (README "Noisy embeddings while learning"). Full fine-tuning: not
# measured, none.
NEFTUNE_ALPHA = 5.0
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


def passes_for(train_tokens: int) -> int:
    """The default's passes over a dataset of `train_tokens` tokens: the most, from two to
    MOST_PASSES, that read no more than PASS_TOKENS (two above that)."""
    return max(2, min(MOST_PASSES, PASS_TOKENS // max(1, train_tokens)))


def learning_rate_for(method: str, epochs: int) -> float:
    """The default step of `method` over `epochs` passes."""
    if method != "lora":
        return FULL_LR
    if epochs <= 2:
        return LORA_LR_TWO_PASSES
    return LORA_LR_THREE_PASSES if epochs == 3 else LORA_LR


def default_params(n_words: int, n_qa: int = 0, method: str = "lora") -> dict:
    """Defaults that finish in minutes on a CPU with the embedded 135M model.

    Small datasets need more passes to be learned at all (Northwind: 11-19 of 60 colleague
    questions on three passes, 10 on two); large ones fewer, at a larger LoRA step, so the
    training time stays roughly bounded (PASS_TOKENS). The passes and LoRA's step here are
    guessed from the words; the job sets them from its dataset's tokens (`settle`) unless
    the user chose them (`AUTO` lists the ones left to the job; `chosen` takes the user's
    out).
    """
    epochs = passes_for(n_words * TRAIN_TOKENS_PER_WORD + n_qa * TRAIN_TOKENS_PER_QA)
    return {
        "method": method,
        "epochs": epochs,
        # LoRA adapters tolerate (and on tiny data need) a far larger step than full FT.
        "learning_rate": learning_rate_for(method, epochs),
        "lora_rank": 16,
        "max_seq_len": 256,
        "neftune_alpha": NEFTUNE_ALPHA if method == "lora" else 0.0,
        "generated_qa": GENERATED_QA,
        "replay": REPLAY,
        "holdout_frac": HOLDOUT_FRAC if n_words >= HOLDOUT_FROM_WORDS else 0.0,
        AUTO: ["epochs", "learning_rate"],
    }


def chosen(params: dict, overrides: dict) -> dict:
    """`params` (default_params) with the user's `overrides`: what they set is no longer
    left to the job's dataset."""
    left = [k for k in params.get(AUTO) or [] if k not in overrides]
    mine = {**params, **overrides, AUTO: left}
    if "learning_rate" in left and "epochs" in overrides:  # the step for the chosen passes
        mine["learning_rate"] = learning_rate_for(str(mine.get("method")), int(mine["epochs"]))
    return mine


def settle(params: dict, train_tokens: int) -> dict:
    """The settings `params` leaves to the dataset (AUTO), set for one of `train_tokens`
    tokens: the passes, and the step for those passes (or for the passes the user chose)."""
    auto = set(params.get(AUTO) or [])
    settled = {}
    if "epochs" in auto:
        settled["epochs"] = passes_for(train_tokens)
    if "learning_rate" in auto:
        epochs = int(settled.get("epochs", params.get("epochs") or 1))
        settled["learning_rate"] = learning_rate_for(str(params.get("method") or "lora"), epochs)
    return settled
