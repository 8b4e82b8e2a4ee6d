"""NEFTune's noisy embeddings (worker.training.noise): noise of the paper's scale while the
model trains, none while it is evaluated or after, each row's the same in any batch; the
default LoRA job trains with it."""

import copy

import pytest
import torch


def test_noise_only_while_training_at_the_papers_scale(tiny_model):
    from worker.training.noise import noisy_embeddings

    model = copy.deepcopy(tiny_model)
    embed = model.get_input_embeddings()
    ids = torch.tensor([list(range(10, 26))])
    clean = embed(ids)
    width = clean.size(-1)
    with noisy_embeddings(model, 0):  # 0: no hook at all
        model.train()
        assert torch.equal(embed(ids), clean)
    step = [0]
    with noisy_embeddings(model, 5, seed=0, step_of=lambda: step[0], pad_token_id=0):
        model.train()
        noisy = embed(ids)
        scale = 5 / (16 * width) ** 0.5
        gap = (noisy - clean).abs()
        assert 0 < gap.max() <= scale
        assert gap.mean() > scale / 4  # uniform on [-scale, scale]: mean |noise| = scale / 2
        assert torch.equal(embed(ids), noisy)  # the same row at the same step: the same noise
        step[0] = 1
        assert not torch.equal(embed(ids), noisy)  # fresh noise the next step
        model.eval()
        assert torch.equal(embed(ids), clean)  # evaluation sees the clean embeddings
        model.train()
    assert torch.equal(embed(ids), clean)  # and training after it too: the hook is gone
    model.eval()


def test_a_rows_noise_does_not_depend_on_its_batch():
    """What keeps a data-parallel run (each rank a share of the batch, padded to its own
    width) and a resumed one equal to one process straight through."""
    from worker.training.noise import row_noise

    short, long = torch.tensor([5, 6, 7]), torch.tensor([5, 6, 7, 8, 9, 10])
    alone = row_noise(short, 8, 5.0, seed=1, step=3, pad_token_id=0)
    padded = row_noise(torch.cat([short, torch.zeros(3, dtype=torch.long)]), 8, 5.0, 1, 3, 0)
    assert torch.equal(padded[:3], alone) and not padded[3:].any()  # padding gets none
    assert alone.abs().max() <= 5.0 / (3 * 8) ** 0.5  # the row's own length
    assert not torch.equal(row_noise(long, 8, 5.0, 1, 3, 0)[:3], alone)  # another row
    assert not torch.equal(row_noise(short, 8, 5.0, 2, 3, 0), alone)  # another seed
    assert not torch.equal(row_noise(short, 8, 5.0, 1, 4, 0), alone)  # another step
    assert not row_noise(torch.zeros(4, dtype=torch.long), 8, 5.0, 1, 3, 0).any()


def test_training_with_noise_moves_the_adapter_differently(tiny_model, tmp_path):
    from worker.training.recipe import EngineOptions, FineTuneRecipe, TrainConfig

    def trained(alpha: float) -> dict:
        model = copy.deepcopy(tiny_model)
        example = {"input_ids": list(range(10, 26)), "labels": list(range(10, 26))}
        config = TrainConfig(epochs=1, learning_rate=1e-3, max_seq_len=32, batch_size=1,
                             checkpoint_every=100, neftune_alpha=alpha)
        recipe = FineTuneRecipe(model, [example] * 3, config, tmp_path / str(alpha),
                                pad_token_id=0, engine=EngineOptions(kind="memory"))
        recipe.setup()
        recipe.train()
        out = {n: p.detach().clone() for n, p in recipe.model.named_parameters()
               if p.requires_grad}
        recipe.cleanup(remove_checkpoint=True)
        return out

    plain, noisy, again = trained(0), trained(15), trained(15)
    assert any(not torch.equal(plain[n], noisy[n]) for n in plain)
    assert all(torch.equal(noisy[n], again[n]) for n in plain)  # the recipe's seed: the same run


def test_the_default_lora_job_trains_with_noise_and_full_fine_tuning_without(tmp_path):
    from app.contract.training import NEFTUNE_ALPHA, default_params
    from scripts.experiments.recall import load_corpus, recipe_spec
    from worker.errors import UserFacingError
    from worker.jobs.pipeline import job_settings
    from worker.training.recipe import TrainConfig

    docs = load_corpus(tmp_path)  # the fixture corpus as the worker extracts it
    for method, alpha in (("lora", NEFTUNE_ALPHA), ("full", 0.0)):
        params = default_params(862, 12, method)
        assert params["neftune_alpha"] == alpha
        assert job_settings(docs, params, "", None, None).config.neftune_alpha == alpha
    assert NEFTUNE_ALPHA > 0
    assert recipe_spec("default", docs)["neftune_alpha"] == NEFTUNE_ALPHA  # the experiment's
    assert TrainConfig().neftune_alpha == 0.0  # a job stored before it trains as it did
    with pytest.raises(UserFacingError, match="neftune_alpha"):
        TrainConfig(neftune_alpha=-1.0)
