"""DPTrainer stays within target_epsilon: the noise is calibrated to it, a given noise multiplier is checked against it
before step 1, and training stops before a step that would exceed it."""

from __future__ import annotations

import math

import pytest

from hf_dp import accounting
from trainer_fixtures import make_trainer


# ---- the noise is calibrated to the target ------------------------------------------------------------------------


def test_calibrated_noise_meets_the_target(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=-1, num_train_epochs=2, target_epsilon=3.0)
    plan = trainer.privacy_plan
    assert plan.steps == math.ceil(2 / plan.sample_rate)
    assert plan.delta == pytest.approx(1 / (10 * trainer.partition.num_users))
    spent = accounting.epsilon(sample_rate=plan.sample_rate, noise_multiplier=plan.noise_multiplier,
                               steps=plan.steps, delta=plan.delta)
    assert spent <= 3.0
    assert spent > 2.8  # the smallest σ that meets the target, not a needlessly large one


# ---- a given noise multiplier whose first step exceeds the target is refused --------------------------------------


def test_a_first_step_above_the_target_is_refused_at_construction(tmp_path):
    with pytest.raises(ValueError, match="first step alone.*raise --target_epsilon or --noise_multiplier"):
        make_trainer(tmp_path, noise_multiplier=0.3, target_epsilon=1.0)


# ---- training stops before a step that would exceed the target ----------------------------------------------------


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
