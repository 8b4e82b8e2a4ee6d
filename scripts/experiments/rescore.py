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


def _share(items: list[dict], key: str = "hit") -> str:
    return f"{sum(bool(i[key]) for i in items)}/{len(items)}"


def _by_kind(items: list[dict], key: str) -> dict[str, str]:
    kinds: dict[str, list[dict]] = {}
    for i in items:
        kinds.setdefault(i["kind"], []).append(i)
    return {k: _share(v, key) for k, v in kinds.items()}


def _gap(card: list[dict], colleagues: list[dict], key: str) -> float:
    def pct(items: list[dict]) -> float:
        return 100 * sum(bool(i[key]) for i in items) / len(items) if items else 0.0

    return round(pct(card) - pct(colleagues), 1)


def rescore_recipe(recipe: dict) -> dict:
    """One recipe's saved replies scored as they were and as today's code scores them."""
    from scripts.experiments.recall import by_fact
    from worker.dataset.probes import gives_answer

    card = [dict(i, now=gives_answer(i["output"], i["answer"])) for i in recipe["card_items"]]
    colleagues = [dict(i, now=gives_answer(i["output"], i["answer"]))
                  for i in recipe["employee_items"]]
    sides = {}
    for key, name in (("hit", "saved"), ("now", "now")):
        as_scored = [dict(i, hit=i[key]) for i in card]
        asked = [dict(i, hit=i[key]) for i in colleagues]
        sides[name] = {
            "employee": _share(colleagues, key),
            "employee_by_kind": _by_kind(colleagues, key),
            "card": _share(card, key),
            "card_by_kind": _by_kind(card, key),
            "gap_points": _gap(card, colleagues, key),
            "by_fact": by_fact(as_scored, asked),
        }
    changed = [
        {"side": side, "question": i["question"], "answer": i["answer"], "output": i["output"],
         "now": i["now"]}
        for side, items in (("card", card), ("colleague", colleagues))
        for i in items if bool(i["hit"]) != i["now"]
    ]
    return sides | {"changed": changed}


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
        for name, recipe in run["recipes"].items():
            r = rescore_recipe(recipe)
            out[f"{path.name}:{name}"] = r
            print(f"# {path.name} {name}", flush=True)
            for side in ("saved", "now"):
                s = r[side]
                print(f"  {side:<6} colleague {s['employee']:>6} {s['employee_by_kind']}  "
                      f"card {s['card']:>6}  gap {s['gap_points']:>6}  {s['by_fact']}")
            for c in r["changed"]:
                verdict = "right" if c["now"] else "wrong"
                print(f"  now {verdict}: [{c['side']}] {c['question']} ({c['answer']}) -> "
                      f"{c['output'][:120]!r}")
    print(json.dumps(out, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
