"""DPTrainer end to end on tiny config-built models and tiny user datasets."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
from scipy import stats
from transformers import HfArgumentParser

from hf_dp import DPTrainer, DPTrainingArguments, UnsupportedLayerError, accounting
from hf_dp.accounting import planner
from hf_dp.sampling import PoissonBatchSampler
from trainer_fixtures import make_args, make_trainer, pad_collator, tiny_bert, tiny_llama, user_dataset


def fresh_epsilon(report: dict, group_size: int = 1) -> float:
    return accounting.epsilon(sample_rate=report["sample_rate"], noise_multiplier=report["effective_noise_multiplier"],
                              steps=report["steps"], delta=report["delta"], group_size=group_size)


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
    # ULS "auto" chose G with ε-DP (0.1): it adds to DP-SGD's ε (tests/trainer/test_data_dependent_choices.py)
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
    assert "differential-privacy" in card and f"{report['epsilon']:.2f}" in card


def test_calibrated_noise_meets_the_target(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=-1, num_train_epochs=2, target_epsilon=3.0)
    plan = trainer.privacy_plan
    assert plan.steps == math.ceil(2 / plan.sample_rate)
    assert plan.delta == pytest.approx(1 / (10 * trainer.partition.num_users))
    spent = accounting.epsilon(sample_rate=plan.sample_rate, noise_multiplier=plan.noise_multiplier,
                               steps=plan.steps, delta=plan.delta)
    assert spent <= 3.0
    assert spent > 2.8  # the smallest σ that meets the target, not a needlessly large one


def test_poisson_batch_sizes_follow_the_binomial():
    num_units, q, steps = 200, 0.05, 2000
    sizes = np.array([s.total for s in PoissonBatchSampler(num_units, q, steps, seed=7)])
    assert (sizes == 0).sum() >= 0  # empty batches are legal
    observed = np.bincount(sizes, minlength=num_units + 1)
    expected = stats.binom.pmf(np.arange(num_units + 1), num_units, q) * steps
    keep = expected >= 5  # chi-square validity; pool the tails
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    assert stats.chisquare(obs, exp).pvalue > 1e-3
    # Two ranks split the same sample: their shares are disjoint and cover it.
    rank0 = list(PoissonBatchSampler(num_units, q, 50, seed=7, rank=0, world_size=2))
    rank1 = list(PoissonBatchSampler(num_units, q, 50, seed=7, rank=1, world_size=2))
    single = list(PoissonBatchSampler(num_units, q, 50, seed=7))
    for a, b, whole in zip(rank0, rank1, single):
        assert sorted(np.concatenate([a.units, b.units]).tolist()) == whole.units.tolist()


def test_trainer_trains_on_the_poisson_sample(tmp_path):
    """The batches the trainer trains on are exactly the sampler's Poisson draws (tested above)."""
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


def test_noise_is_really_added(tmp_path):
    """All labels masked: the clipped gradient is exactly 0, so the update is the noise alone."""
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


def test_contribution_bound_is_applied(tmp_path):
    trainer = make_trainer(tmp_path, sampling="els", contribution_bound=2)
    assert trainer.partition.rows_per_user().max() == 2
    auto = make_trainer(tmp_path, sampling="els", contribution_bound="auto")
    # An ε-DP median from the public grid (24 users: barely informative at ε = 0.1), never read exactly.
    assert auto.partition.contribution_bound in planner.CONTRIBUTION_BOUND_GRID
    assert auto.partition.rows_per_user().max() <= auto.partition.contribution_bound
    assert auto.accountant.pure_dp == [{"label": "contribution_bound", "epsilon": 0.1}]


def test_resume_reproduces_an_uninterrupted_run_and_keeps_the_ledger(tmp_path):
    straight = make_trainer(tmp_path / "a", model=tiny_bert(seed=1), max_steps=4)
    straight.train()
    first = make_trainer(tmp_path / "b", model=tiny_bert(seed=1), max_steps=4, save_strategy="steps", save_steps=2)
    first.train()
    checkpoint = tmp_path / "b" / "out" / "checkpoint-2"
    ledger = json.loads((checkpoint / "dp_ledger.json").read_text())
    assert ledger["accountant"]  # the ledger is saved with the checkpoint
    assert "data_secret" not in ledger and "data_secret" in json.loads((checkpoint / "dp_resume.json").read_text())
    resumed = make_trainer(tmp_path / "c", model=tiny_bert(seed=99), max_steps=4)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.accountant.steps == 4
    assert resumed.privacy_report()["epsilon"] == pytest.approx(straight.privacy_report()["epsilon"], rel=1e-9)
    for (name, a), (_, b) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        torch.testing.assert_close(a, b, msg=f"{name} differs after resume")


def test_resume_with_other_privacy_arguments_is_refused(tmp_path):
    first = make_trainer(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    first.train()
    checkpoint = str(tmp_path / "out" / "checkpoint-2")
    other = make_trainer(tmp_path, max_steps=4, max_grad_norm=0.5)
    with pytest.raises(ValueError, match="different privacy configuration.*max_grad_norm"):
        other.train(resume_from_checkpoint=checkpoint)
    os.remove(os.path.join(checkpoint, "dp_ledger.json"))
    same = make_trainer(tmp_path, max_steps=4)
    with pytest.raises(ValueError, match="no privacy ledger"):
        same.train(resume_from_checkpoint=checkpoint)


def test_training_stops_before_exceeding_the_target(tmp_path):
    sigma = 1.0
    trainer = make_trainer(tmp_path, max_steps=200, noise_multiplier=sigma, target_epsilon=1.5, learning_rate=0.0)
    trainer.train()
    plan = trainer.privacy_plan
    spent = trainer.privacy_report()["epsilon"]
    assert trainer.accountant.steps < 200
    assert spent <= 1.5
    one_more = accounting.epsilon(sample_rate=plan.sample_rate, noise_multiplier=plan.effective_noise_multiplier,
                                  steps=trainer.accountant.steps + 1, delta=plan.delta)
    assert one_more > 1.5


def test_no_gradient_reaching_the_optimizer_stops_training(tmp_path):
    model = tiny_bert()
    stale = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    trainer = DPTrainer(model=model, args=make_args(tmp_path), train_dataset=user_dataset(),
                        data_collator=pad_collator, optimizers=(torch.optim.SGD(stale, lr=0.1), None))
    with pytest.raises(RuntimeError, match="no gradient"):
        trainer.train()


@pytest.mark.parametrize(
    "dataset_kwargs, arg_overrides, message",
    [
        ({}, {"user_id_column": "author"}, "no user column 'author'"),
        ({"user_ids": ["only-one"]}, {"expected_batch_size": 1}, "1 user"),
        ({}, {"target_epsilon": 1e-6, "target_delta": 1e-6, "max_steps": 500, "contribution_bound": 4},
         "Raise --target_epsilon"),
        ({}, {"expected_batch_size": 1000}, "lower --expected_batch_size"),
        ({}, {"target_delta": 0.5}, "(?i)lower.*delta"),
    ],
    ids=["no-user-column", "one-user", "unreachable-epsilon", "sample-rate-above-1", "delta-too-large"],
)
def test_bad_inputs_give_clear_errors(tmp_path, dataset_kwargs, arg_overrides, message):
    with pytest.raises(ValueError, match=message):
        make_trainer(tmp_path, dataset=user_dataset(**dataset_kwargs), **arg_overrides)


def test_unsupported_trainable_layer_is_refused_before_training(tmp_path):
    model = tiny_bert()
    model.classifier.scale = torch.nn.Parameter(torch.ones(2))  # a raw parameter no rule covers
    original_forward = model.classifier.forward
    model.classifier.forward = lambda x: original_forward(x) * model.classifier.scale
    with pytest.raises(UnsupportedLayerError, match="classifier"):
        make_trainer(tmp_path, model=model)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"privacy_unit": "row"}, "privacy_unit"),
        ({"sampling": "shuffle"}, "sampling"),
        ({"target_epsilon": -1.0}, "target_epsilon"),
        ({"target_epsilon": None}, "noise_multiplier"),
        ({"contribution_bound": "many"}, "contribution_bound"),
        ({"gradient_accumulation_steps": 4}, "expected_batch_size"),
        ({"max_grad_norm": 0.0}, "max_grad_norm"),
        ({"fp16": True}, "bf16"),
        ({"label_smoothing_factor": 0.1}, "label_smoothing_factor"),
        ({"fsdp": "full_shard"}, "FSDP"),
    ],
)
def test_argument_validation(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        make_args(tmp_path, **overrides)


def test_arguments_are_cli_flags():
    parser = HfArgumentParser(DPTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(
        ["--output_dir", "x", "--target_epsilon", "3", "--sampling", "els", "--contribution_bound", "4",
         "--user_id_column", "author", "--use_cpu", "true"]
    )
    assert (args.target_epsilon, args.sampling, args.contribution_bound, args.user_id_column) == \
        (3.0, "els", 4, "author")
    help_text = parser.format_help()
    for flag in ["--target_delta", "--privacy_unit", "--expected_batch_size", "--noise_seed", "--noise_multiplier"]:
        assert flag in help_text


def test_evaluation_during_training_keeps_working(tmp_path):
    data = user_dataset()
    trainer = DPTrainer(model=tiny_bert(), args=make_args(tmp_path, eval_strategy="steps", eval_steps=2),
                        train_dataset=data, eval_dataset=user_dataset(seed=9), data_collator=pad_collator)
    trainer.train()
    evaluations = [e for e in trainer.state.log_history if "eval_loss" in e]
    assert len(evaluations) == 2 and all(math.isfinite(e["eval_loss"]) for e in evaluations)
    assert trainer.accountant.steps == 4  # evaluation spends no budget


def test_the_callers_arguments_are_left_untouched(tmp_path):
    """Planning sets max_steps on the trainer's own copy: the same arguments can start a second run."""
    args = make_args(tmp_path, max_steps=-1, num_train_epochs=1.0)
    trainer = DPTrainer(model=tiny_bert(), args=args, train_dataset=user_dataset(), data_collator=pad_collator)
    assert trainer.args.max_steps == trainer.privacy_plan.steps > 0
    assert (args.max_steps, args.ignore_data_skip) == (-1, False)
