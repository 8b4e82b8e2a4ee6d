"""Does the tuned model know when it is wrong? Two signals a chat could show, against the
colleague questions it gets right and wrong.

Trains a recipe as the recall experiment does (scripts/experiments/recall.py, the same run)
and, for every colleague question and every score card question, measures:

- the model's own token probabilities in its greedy answer, summed up three ways: the
  smallest (`min`), the geometric mean (`mean`), the first token's (`first`);
- the agreement of K sampled answers with the greedy one (SelfCheckGPT's idea, Manakul et
  al. 2023): the share of samples that contain every name and figure of the greedy answer's
  first sentence that the question does not (`agree names`), and the share of its other
  words they repeat (`agree words`).

For each: AUROC (the chance a right answer scores above a wrong one; 0.5 is no signal) and,
at a few thresholds, how many answers are "sure" and how many of those are right. A signal
worth showing in the chat would separate them clearly (AUROC well above 0.8) on both corpora.

    .venv/bin/python -m scripts.experiments.confidence                       # Northwind
    .venv/bin/python -m scripts.experiments.confidence --corpus heldout --temperature 1.0

Prints the tables, then one JSON line with every figure and answer.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

# Words of an answer: names, figures, codes ("£62,000", "NW-4471", "16:30", "6%").
WORD = re.compile(r"[A-Za-z0-9£$€][A-Za-z0-9£$€.,:%-]*[A-Za-z0-9%]|[A-Za-z0-9]")
SENTENCE_END = re.compile(r"(?<![0-9])[.!?](\s|$)")

# One number from an answer's token probabilities.
MEASURES = {
    "min": lambda p: min(p, default=0.0),
    "mean": lambda p: math.exp(sum(math.log(max(x, 1e-12)) for x in p) / len(p)) if p else 0.0,
    "first": lambda p: p[0] if p else 0.0,
}
THRESHOLDS = (0.2, 0.4, 0.5, 0.6, 0.8, 0.9)


def _first_sentence(text: str) -> str:
    return SENTENCE_END.split(text.strip(), maxsplit=1)[0]


def new_words(answer: str, question: str) -> list[str]:
    """The words of the answer's first sentence the question does not have."""
    asked = {w.lower() for w in WORD.findall(question)}
    return [w for w in WORD.findall(_first_sentence(answer)) if w.lower() not in asked]


def names_and_figures(answer: str, question: str) -> list[str]:
    """The answer's new words with a digit, or a capital not at the sentence's start."""
    first = WORD.findall(_first_sentence(answer))[:1]
    return [w for w in new_words(answer, question)
            if any(c.isdigit() for c in w) or (w[0].isupper() and w not in first)]


def agreement(greedy: str, question: str, samples: list[str]) -> dict[str, float]:
    """How far the sampled answers say what the greedy one says (see the module's doc)."""
    words = new_words(greedy, question)
    key = names_and_figures(greedy, question)
    said = [{w.lower() for w in new_words(s, question)} for s in samples]
    mine = {w.lower() for w in words}
    share = [len(mine & s) / len(mine) if mine else 0.0 for s in said]
    names = ([all(w.lower() in s for w in key) for s in said] if key else share)
    return {"agree names": sum(names) / len(samples), "agree words": sum(share) / len(samples)}


def auroc(scores: list[float], right: list[bool]) -> float | None:
    """P(a right answer's score > a wrong one's), ties counting half."""
    pos = [s for s, r in zip(scores, right, strict=True) if r]
    neg = [s for s, r in zip(scores, right, strict=True) if not r]
    if not pos or not neg:
        return None
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def signals(item: dict) -> dict[str, float]:
    probs = item["token_probs"]
    return {name: m(probs) for name, m in MEASURES.items()} | item.get("agreement", {})


def table(items: list[dict]) -> dict:
    """Per signal: AUROC and, per threshold, (sure, right among sure, unsure, right among
    unsure)."""
    right = [bool(i["hit"]) for i in items]
    measured = [signals(i) for i in items]  # once per answer, not once per signal
    out = {}
    for name in measured[0]:
        scores = [m[name] for m in measured]
        rows = []
        for t in THRESHOLDS:
            sure = [r for s, r in zip(scores, right, strict=True) if s >= t]
            unsure = [r for s, r in zip(scores, right, strict=True) if s < t]
            rows.append({"t": t, "sure": len(sure), "sure_right": sum(sure),
                         "unsure": len(unsure), "unsure_right": sum(unsure)})
        out[name] = {"auroc": auroc(scores, right), "rows": rows}
    return out


def measure(samples: int, temperature: float, max_new_tokens: int = 32):
    """recall.run's `also`: asks the colleague and card questions again as they were asked
    (the same greedy answers, now with their token probabilities), then `samples` times
    more at `temperature`."""

    def also(model, tokenizer, after: dict) -> None:
        import torch

        from worker.dataset.build import qa_prompt_ids
        from worker.scoring.evaluate import generate_scored

        torch.manual_seed(0)
        kept = {}
        for name, items, tokens in (("employee", after["employee"]["items"], 48),
                                    ("card", after["questions"]["items"], 48)):
            prompts = [qa_prompt_ids(tokenizer, i["question"]) for i in items]
            answers = generate_scored(model, tokenizer, prompts, tokens)
            rows = []
            for item, answer, prompt in zip(items, answers, prompts, strict=True):
                if answer.text != item["output"]:
                    raise RuntimeError(f"could not reproduce the answer to {item['question']!r}")
                ids = torch.tensor([prompt])
                drawn = model.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                    temperature=temperature, top_p=1.0, top_k=0, max_new_tokens=max_new_tokens,
                    num_return_sequences=samples, pad_token_id=tokenizer.eos_token_id)
                said = [tokenizer.decode(d[len(prompt):], skip_special_tokens=True) for d in drawn]
                rows.append({k: item[k] for k in ("question", "answer", "output", "hit")}
                            | {"token_probs": list(answer.token_probs), "samples": said,
                               "agreement": agreement(item["output"], item["question"], said)})
            kept[name] = rows
        after["also"] = kept

    return also


def report(label: str, items: list[dict]) -> dict:
    t = table(items)
    print(f"\n{label}: {sum(i['hit'] for i in items)}/{len(items)} right "
          "(threshold: right of sure | right of unsure)")
    for name, m in t.items():
        auc = "-" if m["auroc"] is None else f"{m['auroc']:.2f}"
        cells = "  ".join(f"{r['t']:g}: {r['sure_right']}/{r['sure']} | "
                          f"{r['unsure_right']}/{r['unsure']}" for r in m["rows"])
        print(f"  {name:<12} AUROC {auc:>4}   {cells}")
    return t


def main(argv: list[str] | None = None) -> int:
    from scripts.experiments.recall import run

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", default="default", help="as the recall experiment's")
    parser.add_argument("--corpus", choices=("fixture", "heldout"), default="fixture")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--samples", type=int, default=6, help="sampled answers a question")
    parser.add_argument("--temperature", type=float, default=0.5)
    parser.add_argument("--models-dir", default=str(Path.home() / ".cache" / "doctune-tests"))
    args = parser.parse_args(argv)
    result = run([n for n in args.recipes.split(",") if n], Path(args.models_dir),
                 seed=args.seed, corpus=args.corpus,
                 also=measure(args.samples, args.temperature))
    figures = {}
    for recipe, r in result["recipes"].items():
        for asked, items in r["also"].items():
            label = f"{args.corpus} seed {args.seed} {recipe}: {asked} questions"
            figures[label] = report(label, items)
    print(json.dumps({"settings": vars(args), "figures": figures,
                      "items": {k: r["also"] for k, r in result["recipes"].items()}},
                     ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
