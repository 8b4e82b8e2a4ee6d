"""Every question the score card could ask, put to the tuned model: which card would predict
what colleagues see?

The card asks about 28-40 questions drawn from a larger pool (worker.dataset.colleague:
forward questions in other words, questions the other way round, table lookups). A card of
~28 moves ~9 points by chance, too little to tell two ways of drawing it apart. This asks
the whole pool of each trained model (one training run per corpus and seed, as the recall
experiment trains it), then scores ways of drawing the card from the pool's replies, each
beside the colleague score of the same model:

- `card`: the share of the card's own questions right, as the job draws them;
- `headline`: the card's headline, what a colleague would see (app.contract.scores
  colleague_share: the forward questions at OWN_WORDS_ODDS), and the same over the pool;
- `pool`: every question of the pool, each kind as often as the pool has it;
- `colleague mix`: the pool's hits per kind, weighed as the corpus's colleague questions
  are spread over the kinds ("as written" and "other words" both forward);
- completions: every fact-stating sentence continued from the text before its fact, split
  by whether the card's rules can put a forward question to it (`phrased`).

    .venv/bin/python -m scripts.experiments.card_pool --corpus fixture --seeds 0,1,2

Prints a row per run and a JSON line last (every reply kept, for scoring again); --save
writes the runs so far to a file as each ends.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

FORWARD = "other words"
# The colleague kinds (tests/fixtures/docs.py Fact.kind) as the card's kinds.
AS_CARD = {"as written": FORWARD, "other words": FORWARD, "reverse": "reverse", "table": "table"}


def pool_of(docs: list[tuple[str, str]]) -> list[dict]:
    """Every question the card could ask of these (name, text) documents, with its kind."""
    from worker.dataset.colleague import _JOBS, REVERSE, _question_pools

    out = []
    for kind, by_doc in _question_pools(docs).items():
        for queue in by_doc:
            for _, asked in queue:
                out.append({"kind": REVERSE if kind == _JOBS else asked.kind,
                            "question": asked.question, "answer": asked.answer,
                            "source": asked.source})
    return out


def sentences_of(docs: list[tuple[str, str]]) -> list[dict]:
    """Every sentence of the documents that states a fact, as a sentence completion (the
    text before the fact), and whether the card's rules can put a forward question to it
    (`phrased`): the card's forward questions come only from those."""
    from worker.dataset.colleague import other_words
    from worker.dataset.probes import _candidates_for_doc

    out = []
    for d, (name, text) in enumerate(docs):
        for cands in _candidates_for_doc(d, text):
            asked = next((c for c in cands
                          if other_words(replace(c.fact, source=name)) is not None), None)
            c = asked or cands[0]
            out.append({"source": name, "sentence": c.sentence, "prompt": c.prompt,
                        "answer": c.answer, "phrased": asked is not None})
    return out


def asking(pool: list[dict], sentences: list[dict] = ()):
    """recall.run's `also`: the pool asked of each tuned model as the card asks (chat, greedy,
    48 tokens), scored as the card scores."""

    def also(model, tokenizer, after: dict) -> None:
        from worker.dataset.build import qa_prompt_ids
        from worker.dataset.probes import gives_answer
        from worker.scoring.evaluate import generate

        outputs = generate(model, tokenizer, [qa_prompt_ids(tokenizer, q["question"])
                                              for q in pool], 48)
        after["also"] = {"pool": [q | {"output": out, "hit": gives_answer(out, q["answer"])}
                                  for q, out in zip(pool, outputs, strict=True)]}
        if sentences:
            from worker.dataset.build import encode_text

            done = generate(model, tokenizer, [encode_text(tokenizer, s["prompt"])
                                               for s in sentences], 24)
            after["also"]["completions"] = [s | {"output": out, "hit": gives_answer(out, s["answer"])}
                                    for s, out in zip(sentences, done, strict=True)]

    return also


def rate(items: list[dict]) -> float | None:
    return 100 * sum(bool(i["hit"]) for i in items) / len(items) if items else None


def estimates(card: list[dict], pool: list[dict], colleagues: list[dict]) -> dict:
    """The ways of drawing the card, in percent, beside the colleague score."""
    from scripts.experiments.recall import card_headline

    mix: dict[str, int] = {}
    for c in colleagues:
        mix[AS_CARD[c["kind"]]] = mix.get(AS_CARD[c["kind"]], 0) + 1
    by_kind = {k: [p for p in pool if p["kind"] == k] for k in mix}
    weighed = [(n, rate(by_kind[k])) for k, n in mix.items() if by_kind[k]]
    total = sum(n for n, _ in weighed)
    return {
        "colleague": rate(colleagues),
        "card": rate(card),
        "card_headline": card_headline(card),  # what the card says a colleague would see
        "pool_headline": card_headline(pool),
        "pool": rate(pool),
        "colleague_mix": sum(n * r for n, r in weighed) / total if total else None,
        "pool_by_kind": {k: f"{sum(i['hit'] for i in v)}/{len(v)}" for k, v in by_kind.items()},
        "colleague_by_kind": {
            k: f"{sum(c['hit'] for c in colleagues if AS_CARD[c['kind']] == k)}/{n}"
            for k, n in mix.items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    from scripts.experiments.recall import load_corpus, run

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", default="default", help="as the recall experiment's")
    parser.add_argument("--corpus", default="fixture", help="as the recall experiment's")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--models-dir", default=str(Path.home() / ".cache" / "doctune-tests"))
    parser.add_argument("--save", default="", help="a file to write the runs to as each ends")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        docs = [(d.name, d.text) for d in load_corpus(Path(tmp) / "corpus", args.corpus)]
    pool, sentences = pool_of(docs), sentences_of(docs)  # the same for every seed
    runs: dict = {}
    for seed in [int(s) for s in args.seeds.split(",") if s.strip()]:
        result = run([n for n in args.recipes.split(",") if n], Path(args.models_dir),
                     seed=seed, corpus=args.corpus, also=asking(pool, sentences))
        for recipe, r in result["recipes"].items():
            e = estimates(r["card_items"], r["also"]["pool"], r["employee_items"])
            done = r["also"].get("completions", [])
            for phrased in (True, False):
                part = [c for c in done if c["phrased"] is phrased]
                e[f"completions_{'phrased' if phrased else 'unphrased'}"] = (
                    f"{sum(c['hit'] for c in part)}/{len(part)}")
            label = f"{args.corpus} seed {seed} {recipe}"
            print(f"{label:<32} colleague {e['colleague']:5.1f}  card {e['card']:5.1f}  "
                  f"headline {e['card_headline']:5.1f}  pool headline {e['pool_headline']:5.1f}  "
                  f"pool {e['pool']:5.1f}  colleague mix {e['colleague_mix']:5.1f}  "
                  f"pool {e['pool_by_kind']}  colleagues {e['colleague_by_kind']}  completions phrased "
                  f"{e['completions_phrased']} others {e['completions_unphrased']}", flush=True)
            runs[label] = {"estimates": e, "card_items": r["card_items"],
                           "employee_items": r["employee_items"], "pool_items": r["also"]["pool"],
                           "completion_items": r["also"].get("completions", []),
                           "after": r["after"]}
            if args.save:
                Path(args.save).write_text(json.dumps(runs, ensure_ascii=False))
    print(json.dumps({"settings": vars(args), "runs": runs}, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
