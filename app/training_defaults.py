"""Training settings chosen for the corpus size: what the Train button uses unless the
user opens "Advanced". Pure Python so the web app can show them and the worker can use
them without either importing the other's heavy side."""

from __future__ import annotations

METHODS = ("lora", "full")

# Bounds the Advanced form accepts (also enforced by the worker).
LIMITS = {
    "epochs": (1, 50),
    "learning_rate": (1e-6, 1e-2),
    "lora_rank": (1, 256),
    "max_seq_len": (32, 4096),
}


# The recipe measured on the fixture corpus (README "Making recall real", reproduced by
# `python -m scripts.experiments.recall`): practice questions made from the facts, a
# LoRA step large enough to learn them in a few epochs, and the base model's own answers to
# everyday requests replayed alongside.
GENERATED_QA = 2  # practice questions per fact-bearing sentence (worker.dataset)
REPLAY = 16  # everyday requests the base model answers once, trained on too (worker.training.replay)


def default_params(n_words: int, n_qa: int = 0, method: str = "lora") -> dict:
    """Defaults that finish in minutes on a CPU with the embedded 135M model.

    Small corpora need more passes to be learned at all; large ones fewer, so the
    number of optimizer steps (and the wall time) stays roughly bounded. The practice
    questions multiply the examples (about 8x on the fixture corpus), so the passes are
    fewer than text alone would need.
    """
    size = n_words + 30 * n_qa  # a Q&A pair is worth about one short paragraph
    if size < 2_000:
        epochs = 4
    elif size < 10_000:
        epochs = 3
    else:
        epochs = 2
    return {
        "method": method,
        "epochs": epochs,
        # LoRA adapters tolerate (and on tiny data need) a far larger step than full FT.
        "learning_rate": 1e-3 if method == "lora" else 2e-5,
        "lora_rank": 16,
        "max_seq_len": 256,
        "generated_qa": GENERATED_QA,
        "replay": REPLAY,
    }
