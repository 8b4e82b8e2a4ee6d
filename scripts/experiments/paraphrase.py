"""Can the embedded model reword a question the way a colleague would (issue 13: "paraphrases
made with the base model itself")?

Asks SmolLM2-135M-Instruct to reword each of the score card's questions over the fixture
corpus (greedy, chat template, two instructions) and counts the replies that are a well-formed
question (worker.dataset.colleague.well_formed) other than the one asked. Prints every pair,
then one JSON line.

    .venv/bin/python -m scripts.experiments.paraphrase
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

INSTRUCTIONS = (
    (
        "Rewrite this question in other words, as a coworker would ask it. "
        "Reply with the new question only.\n\n"
    ),
    "Paraphrase: ",
)


def main() -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scripts.experiments.recall import default_recipe, load_corpus
    from worker.dataset.build import build_dataset, qa_prompt_ids
    from worker.dataset.colleague import well_formed
    from worker.scoring.evaluate import generate
    from worker.training.base_model import ensure_embedded_model
    from worker.training.resources import configure_threads

    configure_threads()
    model_dir = ensure_embedded_model(Path.home() / ".cache" / "doctune-tests")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with tempfile.TemporaryDirectory() as tmp:
        docs = load_corpus(Path(tmp))
        generated = default_recipe(docs)["generated_qa"]
        split = build_dataset(docs, tokenizer, max_seq_len=256, seed=0, generated_qa=generated)
    asked = [(p.question, p.answer) for p in split.probes if p.question]
    prompts = [qa_prompt_ids(tokenizer, how + q) for how in INSTRUCTIONS for q, _ in asked]
    replies = generate(model, tokenizer, prompts, 32)
    usable = 0
    for (question, answer), reply in zip(asked * len(INSTRUCTIONS), replies, strict=True):
        reply = reply.strip().split("\n")[0]
        ok = well_formed(reply, answer) and reply.casefold() != question.casefold()
        usable += ok
        print(f"{'ok' if ok else '--'} {question!r} -> {reply!r}")
    print(json.dumps({"asked": len(replies), "usable": usable}), file=sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
