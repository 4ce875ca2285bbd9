"""hf_dp.privacy_plan: what the accountant composes, from the arguments and a user partition, before step 1."""
from __future__ import annotations

import logging
import math

import pytest

from hf_dp import accounting
from hf_dp.clipping.adaptive import effective_noise_multiplier
from hf_dp.privacy_plan import PrivacyPlan, plan_privacy
from trainer_fixtures import make_args, user_partition

# 100 users with 1..5 rows (300 rows), at most G = 3 kept: 240 rows.
ROWS = [1, 2, 3, 4, 5] * 20
KEPT = [min(n, 3) for n in ROWS]


def plan_for(tmp_path, **overrides) -> tuple[PrivacyPlan, object]:
    settings = dict(max_steps=20, expected_batch_size=10, target_epsilon=4.0, contribution_bound=3)
    args = make_args(tmp_path, **{**settings, **overrides})
    return plan_privacy(args, user_partition(KEPT, contribution_bound=3), noised_elements=1000), args


def spent(plan, steps=None) -> float:
    return accounting.epsilon(sample_rate=plan.sample_rate, noise_multiplier=plan.effective_noise_multiplier,
                              steps=plan.steps if steps is None else steps, delta=plan.delta,
                              group_size=plan.group_size)


# ---- units, sample rate, steps and δ of each mechanism ----------------------------------------------------------


@pytest.mark.parametrize("overrides, mechanism, units, protected, group", [
    ({"sampling": "uls"}, "uls", 100, 100, 1),
    ({"sampling": "els"}, "els", 240, 100, 3),
    ({"privacy_unit": "example", "contribution_bound": None}, "example", 240, 240, 1),
], ids=["uls", "els", "example"])
def test_each_mechanism_samples_its_units_and_protects_its_privacy_unit(tmp_path, overrides, mechanism, units,
                                                                        protected, group):
    plan, args = plan_for(tmp_path, max_steps=-1, num_train_epochs=2.0, **overrides)
    assert (plan.mechanism, plan.num_units, plan.num_privacy_units, plan.group_size) == \
        (mechanism, units, protected, group)
    assert plan.sample_rate == 10 / units and plan.expected_batch_size == pytest.approx(10)
    assert plan.steps == math.ceil(2.0 / plan.sample_rate) and args.max_steps == -1  # epochs; args untouched
    assert plan.delta == 1 / (10 * protected)
    assert plan.contribution_bound == 3
    # calibrated: the smallest σ_eff whose ε meets the target (within the calibration's tolerance)
    assert 0.97 * 4.0 < spent(plan) <= 4.0


def test_private_logging_splits_the_step_into_three_gaussians(tmp_path):
    plan, args = plan_for(tmp_path)
    ratio = args.logging_noise_ratio
    assert plan.private_logging and plan.logging_noise_multiplier == pytest.approx(ratio * plan.noise_multiplier)
    sigma_eff = (plan.noise_multiplier ** -2 + 2 * plan.logging_noise_multiplier ** -2) ** -0.5
    assert plan.effective_noise_multiplier == pytest.approx(sigma_eff, rel=1e-12)
    quiet, _ = plan_for(tmp_path, private_logging=False)
    assert not quiet.private_logging and quiet.logging_noise_multiplier is None
    assert quiet.effective_noise_multiplier == pytest.approx(quiet.noise_multiplier)
    assert quiet.effective_noise_multiplier == pytest.approx(plan.effective_noise_multiplier, rel=1e-6)  # same ε


def test_a_given_noise_multiplier_is_the_gradient_noise(tmp_path):
    plan, _ = plan_for(tmp_path, noise_multiplier=1.5, target_epsilon=None, logging_noise_ratio=3.0)
    assert (plan.noise_multiplier, plan.logging_noise_multiplier) == (1.5, 4.5)
    assert plan.effective_noise_multiplier == pytest.approx(1.5 / math.sqrt(1 + 2 / 9))
    adaptive, args = plan_for(tmp_path, noise_multiplier=1.5, target_epsilon=None, adaptive_clipping=True)
    assert adaptive.count_noise == 10 / 20 and adaptive.adaptive_clipping.initial_norm == args.max_grad_norm
    assert adaptive.effective_noise_multiplier == pytest.approx(
        effective_noise_multiplier(1.5, 0.5, logging_noise_ratio=args.logging_noise_ratio))


def test_an_auto_bound_leaves_dp_sgd_the_rest_of_the_target(tmp_path):
    given, _ = plan_for(tmp_path)
    auto, _ = plan_for(tmp_path, contribution_bound="auto", contribution_bound_epsilon=0.5)
    assert auto.effective_noise_multiplier > given.effective_noise_multiplier  # more noise: less ε to spend
    assert 0.97 * 3.5 < spent(auto) <= 3.5


# ---- plans no noise can make private are refused ----------------------------------------------------------------


@pytest.mark.parametrize("rows, overrides, message", [
    ([4], {}, "The training data has 1 user: a user-level guarantee needs many users"),
    (KEPT, {"expected_batch_size": 101}, "expected_batch_size=101 exceeds the 100 users available"),
    (KEPT, {"target_delta": 0.01}, r"target_delta=0.01 is not below 1/100 users.*Lower --target_delta"),
    (KEPT, {"target_epsilon": 1e-6, "target_delta": 1e-6, "expected_batch_size": 50, "max_steps": 500},
     "Raise --target_epsilon"),
    (KEPT, {"noise_multiplier": 0.3, "target_epsilon": 1.0}, "spends ε=.* on the first step alone"),
], ids=["one-user", "batch-above-units", "delta-too-large", "unreachable-target", "first-step-too-costly"])
def test_plans_no_noise_can_make_private_are_refused(tmp_path, rows, overrides, message):
    args = make_args(tmp_path, **{"max_steps": 20, "expected_batch_size": 1, "contribution_bound": 3, **overrides})
    with pytest.raises(ValueError, match=message):
        plan_privacy(args, user_partition(rows, contribution_bound=3), noised_elements=1000)


def test_a_plan_whose_noise_sampler_adds_more_than_one_percent_of_delta_is_refused(tmp_path):
    plan, _ = plan_for(tmp_path)
    assert plan.noise_draws_per_step == 1000 + 2  # the parameters, the logged loss and clipped count
    args = make_args(tmp_path, max_steps=20, expected_batch_size=10, target_epsilon=4.0, contribution_bound=3)
    with pytest.raises(ValueError, match="noise sampler.* 1% of δ.*for no ε at all; train fewer steps or fewer "
                                         "parameters"):
        plan_privacy(args, user_partition(KEPT, contribution_bound=3), noised_elements=10**44)


def test_a_target_beyond_the_samplers_range_is_refused_naming_the_largest_it_can_state(tmp_path):
    """ε = 90 passes the arguments' any-model limit (94 at δ = 1e-5) but not this plan's draws: one line naming
    the largest ε this plan can state, never "δ = inf"."""
    args = make_args(tmp_path, max_steps=20, expected_batch_size=10, target_epsilon=90.0, target_delta=1e-5,
                     contribution_bound=3)
    with pytest.raises(ValueError, match=r"^target_epsilon = 90 is beyond what the noise sampler can state.*ask for "
                                         r"ε ≤ \d+\.\d, or train fewer steps or fewer parameters, or raise "
                                         r"--target_delta\.$") as error:
        plan_privacy(args, user_partition(KEPT, contribution_bound=3), noised_elements=10**9)
    assert "inf" not in str(error.value)


def test_a_given_noise_that_outlasts_the_target_warns_that_training_stops_early(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_dp.privacy_plan"):
        plan, _ = plan_for(tmp_path, noise_multiplier=1.0, target_epsilon=2.0, max_steps=500)
    assert spent(plan) > 2.0 and spent(plan, steps=1) <= 2.0
    assert "training will stop early" in caplog.text


# ---- the fingerprint a resumed run must share -------------------------------------------------------------------


def test_the_fingerprint_names_every_setting_the_ledger_depends_on(tmp_path):
    plan, args = plan_for(tmp_path)
    fingerprint = plan.fingerprint(args)
    assert fingerprint["noise_multiplier"] == plan.noise_multiplier and fingerprint["num_units"] == 100
    assert (fingerprint["mechanism"], fingerprint["target_delta"], fingerprint["max_loss"]) == ("uls", plan.delta, 5.0)
    assert fingerprint["adaptive_clipping"] is False and fingerprint["clipping_count_noise"] is None
    other, other_args = plan_for(tmp_path, max_grad_norm=0.5)
    changed = {k for k, v in other.fingerprint(other_args).items() if fingerprint[k] != v}
    assert changed == {"max_grad_norm"}
    quiet, quiet_args = plan_for(tmp_path, private_logging=False, max_loss=9.0)
    assert quiet.fingerprint(quiet_args)["max_loss"] is None  # no loss released: max_loss cannot matter
    adaptive, adaptive_args = plan_for(tmp_path, adaptive_clipping=True, target_unclipped_quantile=0.7)
    saved = adaptive.fingerprint(adaptive_args)
    assert (saved["adaptive_clipping"], saved["target_unclipped_quantile"], saved["clipping_count_noise"]) == \
        (True, 0.7, 0.5)
