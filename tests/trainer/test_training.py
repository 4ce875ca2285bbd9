"""DPTrainer trains with DP-SGD end to end: the ε each mechanism reports, the Poisson sample it trains on, the noise
it adds, and the models, precisions and user ids it trains with (tiny config-built models and user datasets)."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from hf_dp import accounting
from hf_dp.sampling import PoissonBatchSampler
from trainer_fixtures import make_trainer, tiny_bert, tiny_llama, user_dataset


def fresh_epsilon(report: dict, group_size: int = 1) -> float:
    return accounting.epsilon(sample_rate=report["sample_rate"], noise_multiplier=report["effective_noise_multiplier"],
                              steps=report["steps"], delta=report["delta"], group_size=group_size)


# ---- each mechanism reports the ε a fresh accountant computes -----------------------------------------------------


@pytest.mark.parametrize(
    "overrides, units_key, group",
    [
        ({"sampling": "uls"}, "num_users", False),
        ({"sampling": "els", "contribution_bound": 3}, "num_examples", True),
        ({"privacy_unit": "example"}, "num_examples", False),
    ],
    ids=["uls", "els", "example"],
)
def test_modes_report_the_epsilon_a_fresh_accountant_computes(tmp_path, overrides, units_key, group):
    trainer = make_trainer(tmp_path, **overrides)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    report = trainer.privacy_report()
    assert report["steps"] == 4
    assert report["sample_rate"] == pytest.approx(8 / report[units_key])
    expected = fresh_epsilon(report, group_size=report["contribution_bound"] if group else 1)
    assert report["epsilon_training"] == pytest.approx(expected, rel=1e-6)
    # ULS "auto" chose G with ε-DP (0.1): it adds to DP-SGD's ε (tests/trainer/test_contribution_bound.py)
    assert report["epsilon"] == pytest.approx(expected + report["contribution_bound_epsilon"], rel=1e-6)
    assert 0 < report["epsilon"] <= 8.0
    assert report["epsilon_lower"] <= report["epsilon_estimate"] <= report["epsilon"]
    if group:
        assert report["epsilon_group_privacy"] > report["epsilon"]
    else:
        assert report["epsilon_group_privacy"] is None
    moved = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) == len(before)  # every trainable parameter was updated
    logged = [entry for entry in trainer.state.log_history if "dp/epsilon" in entry]
    assert len(logged) == 4 and logged[-1]["dp/epsilon"] == pytest.approx(report["epsilon"], rel=1e-6)
    assert {"dp/noise_multiplier", "dp/sample_rate", "dp/clipped_fraction"} <= set(logged[-1])
    assert "dp/batch_units" not in logged[-1]  # the sampled size is data-dependent: never logged
    card = (tmp_path / "out" / "README.md").read_text()
    assert "dp-sgd" in card and f"{report['epsilon']:.2f}" in card
    assert "no-privacy-guarantee" in card and "differential-privacy" not in card  # a fixed noise_seed: no guarantee


# ---- every step trains on the Poisson sample and adds the noise ---------------------------------------------------


def test_trainer_trains_on_the_poisson_sample(tmp_path):
    """The batches the trainer trains on are exactly the sampler's Poisson draws (tests/test_sampling.py)."""
    trainer = make_trainer(tmp_path, max_steps=30, learning_rate=0.0, noise_multiplier=1.0, target_epsilon=None)
    logged, step = [], trainer.training_step

    def recording_step(model, inputs, *args, **kwargs):  # the sampled size is no longer logged
        logged.append(inputs.total_units)
        return step(model, inputs, *args, **kwargs)

    trainer.training_step = recording_step
    trainer.train()
    plan = trainer.privacy_plan
    drawn = [s.total for s in PoissonBatchSampler(plan.num_units, plan.sample_rate, plan.steps, seed=1234)]
    assert logged == drawn
    assert len(set(drawn)) > 3  # sizes vary from step to step


def test_noise_is_really_added(tmp_path, monkeypatch):
    """All labels masked: the clipped gradient is exactly 0, so the update is the noise alone. (Such data is
    refused before training, so that check is switched off here.)"""
    from hf_dp import compatibility

    monkeypatch.setattr(compatibility, "check_labels", lambda dataset, model: None)
    data = user_dataset(causal_lm=True)
    data = data.map(lambda row: {"labels": [-100] * len(row["labels"])})
    trainer = make_trainer(tmp_path, model=tiny_llama(), dataset=data, max_steps=1, optim="sgd",
                           learning_rate=1.0, weight_decay=0.0, lr_scheduler_type="constant",
                           noise_multiplier=2.0, max_grad_norm=0.5, target_epsilon=None)
    before = torch.cat([p.detach().flatten().clone() for p in trainer.model.parameters()])
    trainer.train()
    after = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    step = (after - before).double()
    expected_std = 2.0 * 0.5 / trainer.args.expected_batch_size
    assert step.mean().abs() < 4 * expected_std / math.sqrt(step.numel())
    assert step.std().item() == pytest.approx(expected_std, rel=0.05)
    _, normality = stats.normaltest(step.numpy())
    assert normality > 1e-4


# ---- models, precisions and user ids ------------------------------------------------------------------------------


@pytest.mark.parametrize("use_lora", [False, True], ids=["full", "lora"])
def test_causal_lm_full_and_lora(tmp_path, use_lora):
    model = tiny_llama()
    if use_lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], lora_alpha=4))
    trainer = make_trainer(tmp_path, model=model, dataset=user_dataset(causal_lm=True), max_steps=3)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainer.train()
    assert trainer.privacy_report()["steps"] == 3
    for name, param in model.named_parameters():
        if name in frozen:
            assert torch.equal(param, frozen[name]), f"frozen {name} moved"


def test_bf16_training_runs(tmp_path):
    model = tiny_bert().to(torch.bfloat16)
    trainer = make_trainer(tmp_path, model=model, max_steps=2)
    trainer.train()
    assert all(torch.isfinite(p.float()).all() for p in model.parameters())


def test_integer_user_ids_and_missing_ids(tmp_path, caplog):
    data = user_dataset(user_ids=[3, 1, 4, 15, 9, 2, 6, 5, 35, 8, 97, 93, 23, 84, 62, 64])
    data = data.add_item({"user_id": None, "input_ids": [1, 2, 3], "labels": 1})
    trainer = make_trainer(tmp_path, dataset=data, max_steps=2, contribution_bound=10)
    assert trainer.partition.num_users == 16
    assert trainer.partition.num_examples == len(data) - 1
    assert "user_id" not in trainer.partition.dataset.column_names
    trainer.train()


def test_secure_noise_trains_with_the_same_epsilon_and_other_noise(tmp_path):
    plain = make_trainer(tmp_path / "a", model=tiny_bert(seed=1), max_steps=3)
    plain.train()
    secure = make_trainer(tmp_path / "b", model=tiny_bert(seed=1), max_steps=3, secure_noise=True)
    secure.train()
    assert secure.privacy_report()["epsilon"] == plain.privacy_report()["epsilon"]
    assert secure.privacy_report()["noise_source"].startswith("cryptographic")
    differs = [not torch.equal(a, b) for a, b in zip(plain.model.parameters(), secure.model.parameters())]
    assert any(differs)  # the same sample, other noise
