"""The previous version's scores on this job's probes and held-out text, for the score
card's "compared with the version it continued" column.
"""

from __future__ import annotations

from pathlib import Path


def score_previous(model, tokenizer, split, folder: Path, evaluate) -> dict:
    """The previous version's scores on this job's probes and held-out text: its adapter is
    put on `model` for the measurement and taken off again (the base weights untouched)."""
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(model, str(folder), is_trainable=False)
    try:
        return evaluate(peft_model, tokenizer, split)
    finally:
        peft_model.unload()
