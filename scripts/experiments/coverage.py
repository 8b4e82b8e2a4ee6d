"""Which colleague questions the training could teach at all, and how often each was answered.

A colleague's answer reaches the model in one of three ways, or none: as the answer of a
practice question or a question-answer pair (the model is asked to write it), only inside the
document text it reads (it never wrote it as an answer), or not at all (a held-out chunk, or
text the extractor lost). This builds a recipe's dataset as the recall experiment does (no
training), puts each hand-written colleague question in one of those classes, and, given a
recall run's saved log (scripts.experiments.recall, its JSON line last), how many of each
class that run answered. What it tells: whether the practice misses the facts colleagues ask
about, or teaches them and the model does not keep them. A JSON line last.

    .venv/bin/python -m scripts.experiments.coverage --corpus fullsize [--log run.log]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

CLASSES = ("practised", "text only", "not trained")


def trained_sides(tokenizer, examples: list[dict]) -> tuple[list[str], list[str]]:
    """(the answers the model is asked to write, the text it reads) of training examples: an
    example whose labels are its inputs is text; any other is a question and its answer."""
    from worker.dataset.corpus import IGNORE_INDEX

    answers: list[str] = []
    texts: list[str] = []
    for e in examples:
        if e["labels"] == e["input_ids"]:
            texts.append(tokenizer.decode(e["input_ids"], skip_special_tokens=True))
        else:
            ids = [t for t in e["labels"] if t != IGNORE_INDEX]
            answers.append(tokenizer.decode(ids, skip_special_tokens=True))
    return answers, texts


def classify(answer: str, answers: list[str], texts: list[str]) -> tuple[str, int]:
    """(the class of a colleague's `answer`, how many trained answers give it)."""
    from worker.dataset.probes import gives_answer

    times = sum(gives_answer(a, answer) for a in answers)
    if times:
        return "practised", times
    if any(gives_answer(t, answer) for t in texts):
        return "text only", 0
    return "not trained", 0


def tally(rows: list[dict]) -> dict:
    """Per class: colleague questions in it, and (where a run's replies were joined) how many
    of them that run answered; per class and kind of question too."""
    from scripts.experiments.recall import shares_by

    out: dict = {}
    for c in CLASSES:
        in_class = [r for r in rows if r["class"] == c]
        entry: dict = {"n": len(in_class)}
        if in_class and "hit" in in_class[0]:
            entry["right"] = sum(bool(r["hit"]) for r in in_class)
            entry["by_kind"] = shares_by(in_class, lambda r: r["kind"])
        out[c] = entry
    practised = [r for r in rows if r["class"] == "practised" and "hit" in r]
    if practised:  # does practising an answer more often make it more likely to be given?
        out["practised_by_times"] = shares_by(
            practised, lambda r: "1" if r["times"] == 1 else "2-3" if r["times"] <= 3 else "4+")
    return out


def coverage(corpus: str, recipe: str, seed: int, models_dir: Path,
             saved: list[dict] | None = None) -> dict:
    """Each colleague question of `corpus` classed under `recipe`'s dataset (seed `seed`), with
    the hits of `saved` (a run's employee_items, in the same order) where given."""
    from transformers import AutoTokenizer

    from scripts.experiments.recall import (
        Levers,
        building_with,
        corpus_of,
        load_corpus,
        recipe_spec,
    )
    from worker.dataset.build import build_dataset
    from worker.training.base_model import ensure_embedded_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_embedded_model(models_dir))
    with tempfile.TemporaryDirectory(prefix="doctune-coverage-") as tmp:
        docs = load_corpus(Path(tmp) / "corpus", corpus)
    spec = recipe_spec(recipe, docs)
    lv = Levers.popped(spec)
    held = {k: spec[k] for k in ("holdout_frac",) if k in spec}
    with building_with(lv, seed):  # as the recall experiment builds it
        split = build_dataset(docs, tokenizer, max_seq_len=256, seed=seed,
                              generated_qa=lv.generated_qa, **held)
    answers, texts = trained_sides(tokenizer, split.train_examples)
    facts = corpus_of(corpus)[1]
    if saved is not None and [s["question"] for s in saved] != [f.question for f in facts]:
        raise SystemExit("the log's colleague questions are not this corpus's")
    rows = []
    for i, fact in enumerate(facts):
        c, times = classify(fact.answer, answers, texts)
        row = {"question": fact.question, "answer": fact.answer, "kind": fact.kind,
               "class": c, "times": times}
        if saved is not None:
            row["hit"] = bool(saved[i]["hit"])
        rows.append(row)
    return {"corpus": corpus, "recipe": recipe, "seed": seed, "n_answers": len(answers),
            "n_texts": len(texts), "classes": tally(rows), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    from scripts.experiments.recall import corpus_name
    from scripts.experiments.rescore import last_json_line

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=corpus_name, default="fixture")
    parser.add_argument("--recipe", default="default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--models-dir", default=str(Path.home() / ".cache" / "doctune-tests"))
    parser.add_argument("--log", help="a recall run's output (its JSON line last): join its "
                        "colleague replies; the recipe is read from it")
    args = parser.parse_args(argv)
    saved = None
    if args.log:
        run = last_json_line(Path(args.log).read_text(errors="replace"))
        recipes = (run["seeds"][str(args.seed)] if "seeds" in run else run)["recipes"]
        if args.recipe not in recipes:
            parser.error(f"{args.recipe} is not in {args.log}: {list(recipes)}")
        saved = recipes[args.recipe]["employee_items"]
    result = coverage(args.corpus, args.recipe, args.seed, Path(args.models_dir), saved)
    print(f"{args.corpus}, {args.recipe}, seed {args.seed}: {result['n_answers']} answers "
          f"trained, {result['n_texts']} text chunks", file=sys.stderr)
    for c, entry in result["classes"].items():
        print(f"  {c}: {entry}")
    for r in result["rows"]:
        mark = "" if "hit" not in r else ("+ " if r["hit"] else "- ")
        print(f"  {mark}[{r['class']}, {r['times']}x, {r['kind']}] {r['question']} -> "
              f"{r['answer']}")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
