"""NEFTune's noisy embeddings (worker.training.noise): noise of the paper's scale while the
model trains, none while it is evaluated or after; the default LoRA job trains with it."""

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
    torch.manual_seed(0)
    with noisy_embeddings(model, 5):
        model.train()
        noisy = embed(ids)
        scale = 5 / (16 * width) ** 0.5
        gap = (noisy - clean).abs()
        assert 0 < gap.max() <= scale
        assert gap.mean() > scale / 4  # uniform on [-scale, scale]: mean |noise| = scale / 2
        assert not torch.equal(embed(ids), noisy)  # fresh noise every step
        model.eval()
        assert torch.equal(embed(ids), clean)  # evaluation sees the clean embeddings
        model.train()
    assert torch.equal(embed(ids), clean)  # and training after it too: the hook is gone
    model.eval()


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
