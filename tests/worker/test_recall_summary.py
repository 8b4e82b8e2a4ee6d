"""The recall experiment's summary over seeds (scripts/experiments/recall.py): one run is worth
about +-5 colleague questions, so recipes are compared by their mean and range; and how a
recipe's name sets what it trains."""

from __future__ import annotations

import pytest
import torch

from scripts.experiments.recall import summarize


def _run(hits: int, gap: float, general: float, minutes: float) -> dict:
    return {"after": {"employee": f"{hits}/60", "gap_points": gap, "general_ppl": general},
            "train_minutes": minutes}


def test_mean_range_and_the_gap_furthest_from_zero():
    runs = {
        0: {"recipes": {"full": _run(35, 5.7, 46.4, 10.45), "lora": _run(19, 4.3, 54.8, 9.0)}},
        1: {"recipes": {"full": _run(23, 25.7, 49.0, 10.0)}},
        2: {"recipes": {"full": _run(26, -12.0, 46.6, 10.5)}},
    }
    s = summarize(runs)
    assert s["full"]["runs"] == 3 and s["full"]["n"] == 60
    assert s["full"]["colleague_mean"] == pytest.approx(28.0)
    assert (s["full"]["colleague_min"], s["full"]["colleague_max"]) == (23, 35)
    assert s["full"]["gap_mean"] == pytest.approx((5.7 + 25.7 - 12.0) / 3)
    assert s["full"]["gap_largest"] == 25.7
    assert s["full"]["minutes_mean"] == pytest.approx(10.3167, rel=1e-3)
    assert s["lora"]["runs"] == 1 and s["lora"]["colleague_mean"] == 19


def test_a_recipe_name_takes_overrides_of_the_defaults():
    from scripts.experiments.recall import _known, recipe_spec

    docs = []  # no documents: the defaults of an empty corpus
    spec = recipe_spec("default+generated_qa=4+epochs=6+method=full", docs)
    assert (spec["generated_qa"], spec["epochs"], spec["method"]) == (4, 6, "full")
    # What a recipe names is not left to the dataset; the step follows the method and passes.
    assert spec["auto"] == ["learning_rate"] and spec["learning_rate"] == 2e-5
    assert set(recipe_spec("default", docs)["auto"]) == {"epochs", "learning_rate"}
    assert recipe_spec("qa2+learning_rate=0.002", docs)["learning_rate"] == 0.002
    assert _known("default+epochs=5") and not _known("nonesuch") and not _known("default+epochs")


def test_lora_modules_is_a_recipe_setting():
    from scripts.experiments.recall import _known

    assert _known("default+lora_modules=mlp") and not _known("default+lora_modules=heads")


def test_the_as_probed_ablation_practises_every_fact_as_a_card_fact():
    from scripts.experiments.recall import _ablated, _known
    from worker.dataset import build
    from worker.dataset.questions import Fact

    assert _known("default-as-probed") and not _known("default+ablate=nonesuch")
    sentence = "Laptops are replaced every 42 months."
    start = sentence.index("42 months")
    fact = Fact(sentence, start, start + len("42 months"), "quantity", source="it_policy.html",
                lower_first=True)
    shapes = {t for t, _, _ in build.training_questions(fact, False)}
    assert "fronted" in shapes
    with _ablated("as_probed"):
        assert build.training_questions(fact, False) == build.training_questions(fact, True)
    assert {t for t, _, _ in build.training_questions(fact, False)} == shapes


@pytest.mark.parametrize("which", ["mlp", "layers"])
def test_full_trains_freezes_the_other_weights_before_the_engine_takes_them(
    which, tiny_model, tmp_path
):
    import copy

    from scripts.experiments.recall import FULL_TRAINS, _known, _train_only
    from worker.training.recipe import EngineOptions, FineTuneRecipe, TrainConfig

    assert _known(f"default-qa4-full-1e-4+full_trains={which}")
    assert not _known(f"default+full_trains={which}")  # LoRA: not a setting of it
    assert not _known("default-qa4-full-1e-4+full_trains=heads")
    model = copy.deepcopy(tiny_model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    example = {"input_ids": list(range(10, 26)), "labels": list(range(10, 26))}
    config = TrainConfig(method="full", epochs=1, learning_rate=1e-2, max_seq_len=32,
                         batch_size=1, checkpoint_every=100)
    recipe = FineTuneRecipe(model, [example] * 2, config, tmp_path, pad_token_id=0,
                            engine=EngineOptions(kind="memory"))
    with _train_only(recipe, which):
        recipe.setup()
    recipe.train()
    moved = {n for n, p in recipe.model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all(FULL_TRAINS[which](n) for n in moved)
    assert any(".mlp." in n for n in moved)
    recipe.cleanup(remove_checkpoint=True)


def test_lora_extra_adds_the_output_layer_or_the_embedding_for_one_run():
    from scripts.experiments.recall import _known, _lora_extra
    from worker.training import recipe

    assert _known("default+lora_extra=lm_head") and _known("default+lora_extra=embed_tokens")
    assert _known("default+lora_extra=lm_head/embed_tokens")
    assert not _known("default+lora_extra=norm")
    saved = recipe.LORA_MODULES
    with _lora_extra("lm_head"):
        assert recipe.LORA_MODULES["mlp"] == (*saved["mlp"], "lm_head")
    assert recipe.LORA_MODULES is saved


def test_lora_from_layer_adapts_the_upper_layers_only_for_one_run():
    import peft

    from scripts.experiments.recall import _known, _lora_from_layer

    assert _known("default+lora_from_layer=10") and not _known("default+lora_from_layer=-1")
    assert not _known("default+lora_from_layer=1.5")
    saved = peft.LoraConfig
    with _lora_from_layer(10, 30):
        config = peft.LoraConfig(r=4, target_modules=["q_proj"])
        assert config.layers_to_transform == list(range(10, 30))
    assert peft.LoraConfig is saved
    with _lora_from_layer(0, 30):  # 0: every layer, as the job adapts them
        assert peft.LoraConfig is saved


def test_embedding_lr_trains_the_shared_embedding_beside_the_adapter_at_its_own_step(
    tiny_model, tmp_path
):
    import copy

    from scripts.experiments.recall import _embedding_trained, _known
    from worker.training.recipe import EngineOptions, FineTuneRecipe, TrainConfig

    assert _known("default+embedding_lr=1e-4")
    assert not _known("default-qa4-full-1e-4+embedding_lr=1e-4")  # full trains it anyway
    model = copy.deepcopy(tiny_model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    example = {"input_ids": list(range(10, 26)), "labels": list(range(10, 26))}
    config = TrainConfig(epochs=1, learning_rate=1e-2, max_seq_len=32, batch_size=1,
                         checkpoint_every=100)
    recipe = FineTuneRecipe(model, [example] * 3, config, tmp_path, pad_token_id=0,
                            engine=EngineOptions(kind="memory"))
    with _embedding_trained(recipe, 1e-3):
        recipe.setup()
    groups = recipe.engine.optimizer.param_groups
    assert [g["initial_lr"] for g in groups] == [1e-2, 1e-3]
    recipe.train()
    # the peft-wrapped names carry a prefix and the adapter's own weights are new
    moved = {n.split("base_model.model.")[-1].replace(".base_layer", "")
             for n, p in recipe.model.named_parameters()
             if "lora_" not in n and not torch.equal(
                 p, before[n.split("base_model.model.")[-1].replace(".base_layer", "")])}
    assert moved == {"model.embed_tokens.weight"}
    assert any("lora_B" in n and p.abs().sum() > 0 for n, p in recipe.model.named_parameters())
    assert "_build_engine" not in vars(recipe)  # the class's own again
    recipe.cleanup(remove_checkpoint=True)


def test_soft_replay_names_what_it_anchors():
    from scripts.experiments.recall import _known

    assert _known("default+soft_replay=true") and _known("default+plain_replay=16+soft_replay=plain")
    assert not _known("default+soft_replay=plain") and not _known("default+soft_replay=yes")


def test_fact_weight_is_a_positive_number():
    from scripts.experiments.recall import _known

    assert _known("default+fact_weight=4") and _known("default+fact_weight=2.5+soft_replay=true")
    assert not _known("default+fact_weight=0") and not _known("default+fact_weight=heavy")


def test_the_text_ablation_leaves_only_the_questions(tmp_path, smol_tokenizer):
    from scripts.experiments.recall import _ablated, load_corpus
    from worker.dataset.build import build_dataset

    docs = load_corpus(tmp_path, "fixture")

    def texts() -> int:
        split = build_dataset(docs, smol_tokenizer, generated_qa=2)
        assert split.stats["n_train_generated_qa"] > 0
        return sum(e["labels"] == e["input_ids"] for e in split.train_examples)

    with _ablated("text"):
        assert texts() == 0
    assert texts() > 0  # and back after it


def test_lora_plus_steps_the_b_matrices_faster_than_the_a_matrices(tiny_model, tmp_path):
    import copy

    from scripts.experiments.recall import _known, _lora_plus
    from worker.training.recipe import EngineOptions, FineTuneRecipe, TrainConfig

    assert _known("default+lora_plus=16")
    assert not _known("default-qa4-full-1e-4+lora_plus=16") and not _known("default+lora_plus=x")
    model = copy.deepcopy(tiny_model)
    example = {"input_ids": list(range(10, 26)), "labels": list(range(10, 26))}
    config = TrainConfig(epochs=1, learning_rate=1e-3, max_seq_len=32, batch_size=1,
                         checkpoint_every=100)
    recipe = FineTuneRecipe(model, [example] * 3, config, tmp_path, pad_token_id=0,
                            engine=EngineOptions(kind="memory"))
    with _lora_plus(recipe, 16):
        recipe.setup()
    names = {id(p): n for n, p in recipe.model.named_parameters()}
    groups = recipe.engine.optimizer.param_groups
    by_lr = {g["initial_lr"]: {"lora_B" in names[id(p)] for p in g["params"]} for g in groups
             if g["params"]}
    assert by_lr == {1e-3: {False}, 1.6e-2: {True}}
    assert sum(len(g["params"]) for g in groups) == sum(
        1 for p in recipe.model.parameters() if p.requires_grad)
    recipe.train()
    assert groups[-1]["lr"] < 1.6e-2  # on the recipe's decay
    assert "_build_engine" not in vars(recipe)
    recipe.cleanup(remove_checkpoint=True)


def test_by_fact_splits_colleagues_by_whether_the_card_asked_their_fact():
    from scripts.experiments.recall import by_fact

    card = [
        {"kind": "other words", "answer": "63 staff", "hit": True},
        {"kind": "other words", "answer": "7:30", "hit": True},
        {"kind": "table", "answer": "4 °C", "hit": False},
    ]
    colleagues = [
        {"kind": "other words", "answer": "63", "hit": False},  # the card's fact, fewer words
        {"kind": "as written", "answer": "7:30", "hit": True},
        {"kind": "other words", "answer": "14 characters", "hit": True},  # not "4 °C"'s
        {"kind": "other words", "answer": "17:30", "hit": False},  # not 7:30's
        {"kind": "table", "answer": "7:30", "hit": True},  # a lookup, not a forward question
    ]
    assert by_fact(card, colleagues) == {
        "card_forward": "2/2", "colleagues_same_facts": "1/2", "colleagues_other_facts": "1/2",
    }


def test_all_three_companies_in_one_project_keep_each_file_and_question_apart(tmp_path):
    """--corpus all: every company's files under names of their own, and each question still
    pointing at the file that answers it (tallied per company)."""
    from scripts.experiments.recall import ALL_OF, by_company, corpus_of, load_corpus

    docs = load_corpus(tmp_path, "all")
    parts = {c: load_corpus(tmp_path / f"one-{c}", part) for c, part in ALL_OF.items()}
    assert len(docs) == sum(len(p) for p in parts.values())
    names = {d.name for d in docs}
    assert len(names) == len(docs)  # six names are shared: not merged
    assert [d.text for d in docs] == [d.text for p in parts.values() for d in p]
    questions = corpus_of("all")[1]
    assert len(questions) == sum(len(corpus_of(part)[1]) for part in ALL_OF.values())
    assert {q.filename for q in questions} <= names
    items = [{"filename": q.filename, "hit": q.filename.startswith("cogwell-")}
             for q in questions]
    assert by_company(items[:3]) == {"northwind": "0/3"}
    assert by_company([{"filename": "onboarding.md", "hit": True}]) == {}  # one company's
    assert by_company(items) == {
        "northwind": f"0/{len(corpus_of('fixture')[1])}",
        "cogwell": f"{len(corpus_of('heldout')[1])}/{len(corpus_of('heldout')[1])}",
        "saltgrove": f"0/{len(corpus_of('fullsize')[1])}",
    }


def test_corpora_joined_by_plus_make_one_project_of_those_named(tmp_path):
    """--corpus fixture+heldout: two companies in one project, named and tallied as all's
    three are; a name that is not a corpus, or one named twice, is refused before any run."""
    import argparse

    from scripts.experiments.recall import by_company, corpus_name, corpus_of, load_corpus

    docs = load_corpus(tmp_path, "fixture+heldout")
    assert {d.name.split("-", 1)[0] for d in docs} == {"northwind", "cogwell"}
    assert len(docs) == len(load_corpus(tmp_path / "a", "fixture")) + len(
        load_corpus(tmp_path / "b", "heldout"))
    questions = corpus_of("fixture+heldout")[1]
    assert {q.filename for q in questions} <= {d.name for d in docs}
    items = [{"filename": q.filename, "hit": True} for q in questions]
    assert by_company(items) == {"northwind": "60/60", "cogwell": "61/61"}
    assert corpus_name("heldout+structured") == "heldout+structured"
    for bad in ("fixture+fixture", "fixture+nowhere", "all+fixture", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            corpus_name(bad)
