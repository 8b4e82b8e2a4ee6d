"""Score a recall run's saved replies again with today's scoring, without training again.

The recall experiment's JSON line (scripts.experiments.recall, its last line of output)
keeps every reply: the card's questions (`card_items`) and the colleague questions
(`employee_items`). When scoring changes (worker.dataset.probes.gives_answer), this prints,
per recipe, the figures before and after, and the replies whose verdict changed: what a
scoring change does to the card and to its colleagues, side by side. A JSON line last.

    .venv/bin/python -m scripts.experiments.rescore run.log [more.log ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def figures(card: list[dict], colleagues: list[dict]) -> dict:
    """The recall experiment's figures of scored items (each with a "hit")."""
    from scripts.experiments.recall import by_fact, card_headline, share, shares_by

    def by_kind(items: list[dict]) -> dict[str, str]:
        return shares_by(items, lambda i: i["kind"])

    def pct(items: list[dict]) -> float:
        return 100 * sum(bool(i["hit"]) for i in items) / len(items) if items else 0.0

    return {
        "employee": share(colleagues),
        "employee_by_kind": by_kind(colleagues),
        "card": share(card),
        "card_by_kind": by_kind(card),
        "gap_points": round(card_headline(card) - pct(colleagues), 1),
        "gap_right_points": round(pct(card) - pct(colleagues), 1),
        "by_fact": by_fact(card, colleagues),
    }


def rescore_recipe(recipe: dict) -> dict:
    """One recipe's saved replies scored as they were and as today's code scores them."""
    from worker.dataset.probes import gives_answer

    def now(items: list[dict]) -> list[dict]:
        return [dict(i, hit=gives_answer(i["output"], i["answer"])) for i in items]

    saved = {"card": recipe["card_items"], "colleague": recipe["employee_items"]}
    scored = {side: now(items) for side, items in saved.items()}
    changed = [
        {"side": side, "question": new["question"], "answer": new["answer"],
         "output": new["output"], "now": new["hit"]}
        for side in saved
        for old, new in zip(saved[side], scored[side], strict=True)
        if bool(old["hit"]) != new["hit"]
    ]
    return {"saved": figures(saved["card"], saved["colleague"]),
            "now": figures(scored["card"], scored["colleague"]), "changed": changed}


def last_json_line(text: str) -> dict:
    """The recall experiment's JSON line: the last line of its output that parses as one."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    raise ValueError("no JSON line: is this the output of scripts.experiments.recall?")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="saved outputs of the recall experiment")
    args = parser.parse_args(argv)
    out = {}
    for path in args.runs:
        try:
            run = last_json_line(path.read_text(errors="replace"))
        except (OSError, ValueError) as e:
            parser.error(f"{path}: {e}")
        # one seed's run, or several (--seeds 0,1: each seed's recipes under "seeds")
        seeded = run["seeds"].items() if "seeds" in run else [("", run)]
        for seed, one in seeded:
            for name, recipe in one["recipes"].items():
                label = f"{path.name}:{name}" + (f":seed{seed}" if seed else "")
                out[label] = r = rescore_recipe(recipe)
                _print(label, r)
    print(json.dumps(out, ensure_ascii=False))
    return 0


def _print(label: str, r: dict) -> None:
    print(f"# {label}", flush=True)
    for side in ("saved", "now"):
        s = r[side]
        print(f"  {side:<6} colleague {s['employee']:>6} {s['employee_by_kind']}  "
              f"card {s['card']:>6}  gap {s['gap_points']:>6}  {s['by_fact']}")
    for c in r["changed"]:
        verdict = "right" if c["now"] else "wrong"
        print(f"  now {verdict}: [{c['side']}] {c['question']} ({c['answer']}) -> "
              f"{c['output'][:120]!r}")


if __name__ == "__main__":
    sys.exit(main())
