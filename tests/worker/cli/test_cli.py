"""`doctune train DIR`: the web job's path headless, as a user's script would run it,
once on the default SQLite file and once on PostgreSQL (DATABASE_URL)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from tests.conftest import ROOT
from tests.fixtures import docs as fx
from tests.migrations.test_migrations import postgres_engine  # noqa: F401  (fixture)


def _doctune(args: list[str], env_extra: dict[str, str], tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ, DOCTUNE_DATA_DIR=str(tmp_path / "data"), **env_extra)
    return subprocess.run([sys.executable, "-m", "worker.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=False)


def _check_trained(proc, out, tiny_base_model):
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])  # the JSON line comes last
    assert result["state"] == "done", result.get("error")
    before, after = result["scores"]["before"], result["scores"]["after"]
    assert before["n_probes"] == after["n_probes"] > 0
    assert isinstance(after["recall"], float) and isinstance(before["recall"], float)
    # Scores only in "scores"; the job's other results under their own keys (Job columns).
    assert set(result["scores"]) == {"before", "after"}
    assert result["export_errors"] == {} and result["metrics"]["steps"] > 0
    assert result["dataset"]["n_train_examples"] > 0 and result["dataset"]["notes"]
    statuses = {d["name"]: d["status"] for d in result["documents"]}
    assert statuses["broken.pdf"] == "failed" and statuses["notes.exe"] == "refused"
    assert sum(s == "extracted" for s in statuses.values()) >= 7
    # The written adapter is a real one: it loads on the base model and changes its output.
    folder = out.parent / "unzipped"
    zipfile.ZipFile(out).extractall(folder)
    base = AutoModelForCausalLM.from_pretrained(tiny_base_model)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        plain = base(ids).logits
        tuned = PeftModel.from_pretrained(base, folder)(ids).logits
    assert not torch.equal(plain, tuned)
    assert (folder / "README.md").read_text().count("sha256") or "SHA" in (folder / "README.md").read_text()


def _corpus(tmp_path):
    src = tmp_path / "docs"
    fx.write_sample_corpus(src)
    fx.make_corrupt(src / "broken.pdf")
    (src / "notes.exe").write_bytes(b"MZ\x90\x00")
    return src


def test_doctune_train_sqlite(tmp_path, tiny_base_model):
    out = tmp_path / "model.zip"
    proc = _doctune(["train", str(_corpus(tmp_path)), "--method", "lora", "--epochs", "1",
                     "--out", str(out), "--json"], {}, tmp_path)
    _check_trained(proc, out, tiny_base_model)


def test_doctune_train_postgres(tmp_path, tiny_base_model, postgres_engine):  # noqa: F811
    url = postgres_engine.url.render_as_string(hide_password=False)
    out = tmp_path / "model.zip"
    proc = _doctune(["train", str(_corpus(tmp_path)), "--epochs", "1", "--out", str(out),
                     "--json"], {"DATABASE_URL": url}, tmp_path)
    _check_trained(proc, out, tiny_base_model)


def test_doctune_train_without_usable_text_says_why(tmp_path, tiny_base_model):
    src = tmp_path / "empty"
    src.mkdir()
    fx.make_txt(src / "blank.txt", ["   "])
    proc = _doctune(["train", str(src), "--json"], {}, tmp_path)
    assert proc.returncode == 1
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["state"] == "failed" and "text" in result["error"].lower()
    assert "Traceback" not in proc.stdout + proc.stderr


def test_the_printed_scores_lead_with_what_a_colleague_would_see(capsys):
    from app.contract.scores import parse_scores
    from tests.app.test_score_card import full_scores, with_kinds
    from worker.cli.main import _print_scores

    # After: table 3 of 3, forward 2 of 4, reverse 0 of 3 (5 of 10); before: one table cell.
    kinds = ["table"] * 3 + ["other words"] * 4 + ["reverse"] * 3
    _print_scores(parse_scores(with_kinds(full_scores(before_hits=1, after_hits=5), kinds)), {})
    out = capsys.readouterr().out
    assert "knowledge recall (questions): 1/10 -> 5/10" in out
    assert "a colleague's questions (estimated from the kinds): 10% -> 43%" in out
    assert "verdict: Answers 5 of 10 questions" in out and "about 43% right" in out
    # An older job's questions carry no kinds: no estimate printed.
    _print_scores(parse_scores(full_scores(after_hits=5)), {})
    assert "estimated" not in capsys.readouterr().out
