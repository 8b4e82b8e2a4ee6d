"""Does the verdict's advice work? "Add question-answer pairs about the facts it misses."

Twelve of the facts whose colleague question the default missed (seed 0, Northwind) get a
question-answer pair, written as a user would put it in a FAQ file (`team_faq.csv`: its own
words, never the colleague question's); twelve other missed facts get none (the control,
which shows how many a second training draws right by chance). The app's default recipe
is trained on the fixture corpus with or without the file (scripts/experiments/recall.py,
the same run), and the colleague questions are counted by group; the FAQ's own questions
are asked too, as written.

    .venv/bin/python -m scripts.experiments.advice --seed 0           # with team_faq.csv
    .venv/bin/python -m scripts.experiments.advice --seed 1 --no-faq  # the same run without

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# (the user's question, the user's answer, the calibration answer it is about)
FAQ = [
    ('Can I work from home?',
     'Yes: office staff may work from home up to two days a week. Plant roles cannot be done remotely.',
     'two days'),
    ("When is Founders' Day?",
     "Founders' Day is 14 March; the whole company closes that day.",
     '14 March'),
    ('Who do I go to if someone gets hurt?',
     'Go to the trained first aider on your floor, who wears a blue lanyard, and call the safety desk on extension 5050.',
     'blue lanyard'),
    ('How much electricity does the Gale Fan Mk II use?',
     'The NW-5820 Gale Fan Mk II draws 45 watts at full speed.',
     '45 watts'),
    ('When is the all-hands meeting?',
     'The all-hands meeting is every Friday at 16:30.',
     '16:30'),
    ('Do new starters get a buddy?',
     'Yes: every newcomer joins the Harbour Buddies programme and is paired with a colleague from another team.',
     'Harbour Buddies'),
    ('What changed in firmware version 3.8.1?',
     'Version 3.8.1: the timer now remembers its last setting after a power cut.',
     'power cut'),
    ('When does Night Breeze mode kick in?',
     'Night Breeze mode slows the fan to its quietest speed between 22:00 and 06:00.',
     '22:00'),
    ('What warranty does the Quiet Hinge have?',
     'The NW-3109 Quiet Hinge has a lifetime warranty.',
     'Quiet Hinge'),
    ('Where do I collect my badge?',
     'Collect your badge from Priya Castellanos at reception in the Port Ellery office.',
     'reception'),
    ('What is the weight of the NW-4471 Torque Sprocket?',
     'The NW-4471 Torque Sprocket weighs 2.3 kg.',
     '2.3 kg'),
    ('How many NW-3109 Quiet Hinges are in stock?',
     'There are 2040 NW-3109 Quiet Hinges in stock.',
     '2040'),
]
# Missed facts that get no pair, and those the fixture's own Q&A files already answer.
CONTROL = ["37.5", "director", "24 months", "NW-Staff-7", "Lantern Room", "£74,000", "9,000",
           "Gale Fan", "Senior Firmware Engineer", "NW-3109", "Gale Fan Mk II", "DeskDock"]
HAD_PAIRS = ["45 days", "sealed", "+44 20 7946 0321"]


def colleague_facts(answers: list[str]) -> list:
    """The colleague questions (not "as written") whose answer is one of `answers`."""
    from tests.fixtures.docs import CALIBRATION

    return [f for f in CALIBRATION if f.kind != "as written" and f.answer in answers]


def tally(items: list[dict], answers: list[str]) -> str:
    """"right/asked" over the colleague questions whose answer is one of `answers`."""
    got = [i for i in items if i["kind"] != "as written" and i["answer"] in answers]
    return f"{sum(i['hit'] for i in got)}/{len(got)}"


def main(argv: list[str] | None = None) -> int:
    from scripts.experiments import recall
    from tests.fixtures.docs import CALIBRATION, Fact, make_qa_csv, write_sample_corpus

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-faq", action="store_true", help="train without team_faq.csv")
    parser.add_argument("--models-dir", default=str(Path.home() / ".cache" / "doctune-tests"))
    args = parser.parse_args(argv)

    def writer(folder: Path) -> list[Path]:
        paths = write_sample_corpus(folder)
        if not args.no_faq:
            paths.append(make_qa_csv(Path(folder) / "team_faq.csv", [(q, a) for q, a, _ in FAQ]))
        return paths

    recall.corpus_of = lambda name: (writer, CALIBRATION)  # this run's corpus

    def also(model, tokenizer, after: dict) -> None:
        as_written = recall.employee_questions(
            model, tokenizer, [Fact("team_faq.csv", q, fact) for q, _, fact in FAQ])
        after["also"] = {"faq_as_written": f"{as_written['hits']}/{as_written['n']}"}

    result = recall.run(["default"], Path(args.models_dir), seed=args.seed, also=also)
    r = result["recipes"]["default"]
    items = r["employee_items"]
    print(json.dumps({
        "seed": args.seed, "faq": not args.no_faq,
        "with a pair": tally(items, [fact for _, _, fact in FAQ]),
        "control": tally(items, CONTROL), "had pairs already": tally(items, HAD_PAIRS),
        "faq asked as written": r["also"]["faq_as_written"],
        "colleague": r["after"]["employee"], "gap": r["after"]["gap_points"],
        "general": r["after"]["general_ppl"], "minutes": r["train_minutes"],
    }, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
