"""Scoring a recall run's saved replies again (scripts/experiments/rescore.py): the saved
figures come back as the run printed them, and a reply whose verdict today's scoring
changes is listed, on the card's side or the colleagues'."""

from __future__ import annotations

import json

from scripts.experiments.rescore import last_json_line, main, rescore_recipe


def _item(kind: str, answer: str, output: str, hit: bool) -> dict:
    return {"kind": kind, "question": f"About {answer}?", "answer": answer, "output": output,
            "hit": hit}


RECIPE = {
    "card_items": [
        _item("other words", "seven years", "We keep them for 7 years.", False),
        _item("table", "SG-2041", "It is SG-2041.", True),
    ],
    "employee_items": [
        _item("other words", "seven years", "Seven years.", True),
        _item("as written", "9:30", "From 09:30.", False),
        _item("table", "131", "We have 13 of them.", False),
        _item("table", "17", "until 17:15", True),  # scored right by the old slip
    ],
}


def test_saved_figures_and_what_changed():
    r = rescore_recipe(RECIPE)
    assert r["saved"]["card"] == "1/2" and r["saved"]["employee"] == "2/4"
    # The headline (what a colleague would see) and the share right agree where the forward
    # questions are all right or all wrong (app.contract.scores.colleague_share).
    assert r["saved"]["gap_points"] == 0.0 and r["saved"]["gap_right_points"] == 0.0
    assert r["now"]["card"] == "2/2" and r["now"]["employee"] == "2/4"
    assert r["now"]["card_by_kind"] == {"other words": "1/1", "table": "1/1"}
    assert r["now"]["employee_by_kind"] == {"other words": "1/1", "as written": "1/1",
                                            "table": "0/2"}
    assert r["now"]["gap_points"] == 50.0
    assert r["now"]["by_fact"]["card_forward"] == "1/1"
    changed = {(c["side"], c["answer"], c["now"]) for c in r["changed"]}
    assert changed == {("card", "seven years", True), ("colleague", "9:30", True),
                       ("colleague", "17", False)}


def test_reads_the_last_json_line_of_a_run(tmp_path, capsys):
    log = tmp_path / "run.log"
    log.write_text("recipe  employee\n# seed 0\n"
                   + json.dumps({"recipes": {"default": RECIPE}}) + "\n")
    assert last_json_line(log.read_text())["recipes"]["default"] == RECIPE
    assert main([str(log)]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert out["run.log:default"]["now"]["card"] == "2/2"


def test_a_run_of_several_seeds_is_rescored_seed_by_seed(tmp_path, capsys):
    """--seeds 0,1 saves each seed's recipes under "seeds": each is scored on its own."""
    other = RECIPE | {"card_items": RECIPE["card_items"][1:]}
    log = tmp_path / "seeds.log"
    log.write_text(json.dumps({"seeds": {"0": {"recipes": {"default": RECIPE}},
                                         "1": {"recipes": {"default": other}}}}) + "\n")
    assert main([str(log)]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert set(out) == {"seeds.log:default:seed0", "seeds.log:default:seed1"}
    assert out["seeds.log:default:seed0"]["now"]["card"] == "2/2"
    assert out["seeds.log:default:seed1"]["now"]["card"] == "1/1"
