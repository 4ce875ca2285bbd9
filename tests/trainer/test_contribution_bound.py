"""The contribution bound G in training: applied to every user, chosen from the data with ε-DP ("auto") and accounted
within the target, free when given; the secret that keyed the choice is in no released artifact."""

from __future__ import annotations

import json

import pytest

from hf_dp import accounting
from hf_dp import mechanism_table
from trainer_fixtures import make_trainer

GRID = mechanism_table.CONTRIBUTION_BOUND_GRID


# ---- the bound is applied to every user ---------------------------------------------------------------------------


def test_contribution_bound_is_applied(tmp_path):
    trainer = make_trainer(tmp_path, sampling="els", contribution_bound=2)
    assert trainer.partition.rows_per_user().max() == 2
    auto = make_trainer(tmp_path, sampling="els", contribution_bound="auto")
    # An ε-DP median from the public grid (24 users: barely informative at ε = 0.1), never read exactly.
    assert auto.partition.contribution_bound in mechanism_table.CONTRIBUTION_BOUND_GRID
    assert auto.partition.rows_per_user().max() <= auto.partition.contribution_bound
    assert auto.accountant.pure_dp == [{"label": "contribution_bound", "epsilon": 0.1}]


# ---- a bound chosen from the data is accounted, a given one costs nothing -----------------------------------------


@pytest.mark.parametrize("sampling", ["uls", "els"])
def test_auto_bound_is_accounted_and_the_total_meets_the_target(tmp_path, sampling):
    trainer = make_trainer(tmp_path, sampling=sampling, target_epsilon=3.0)
    assert trainer.accountant.pure_dp == [{"label": "contribution_bound", "epsilon": 0.1}]
    assert trainer.partition.contribution_bound in GRID
    plan = trainer.privacy_plan
    # DP-SGD is calibrated to what is left of the target after the choice of G.
    sgd = accounting.epsilon(sample_rate=plan.sample_rate, noise_multiplier=plan.effective_noise_multiplier,
                             steps=plan.steps, delta=plan.delta, group_size=plan.group_size)
    assert 2.8 < sgd <= 3.0 - 0.1
    trainer.train()
    report = trainer.privacy_report()
    assert report["contribution_bound_epsilon"] == 0.1
    assert report["epsilon"] == pytest.approx(report["epsilon_training"] + 0.1)
    assert report["epsilon_training"] == pytest.approx(sgd, rel=1e-6)
    assert report["epsilon"] <= 3.0
    assert "ε-DP median" in report["contribution_bound_choice"]
    # The secret that keyed G and the rows is in no released artifact.
    secret = trainer._data_secret
    card = (tmp_path / "out" / "README.md").read_text()
    assert secret not in card and secret not in json.dumps(report, default=str)
    assert secret not in json.dumps(trainer.state.log_history)


def test_given_bound_costs_nothing(tmp_path):
    trainer = make_trainer(tmp_path, contribution_bound=3, target_epsilon=3.0)
    assert trainer.accountant.pure_dp == []
    report = trainer.privacy_report()
    assert report["contribution_bound_epsilon"] == 0 and report["epsilon"] == 0
    assert report["contribution_bound_choice"].startswith("given")
    # "auto" at example level: no bound at all, nothing read
    example = make_trainer(tmp_path, privacy_unit="example", target_epsilon=3.0)
    assert example.accountant.pure_dp == [] and example.partition.contribution_bound is None
