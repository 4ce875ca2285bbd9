"""hf_dp.budget: the run's ε so far, and whether the next step keeps it within the target."""
from __future__ import annotations

import logging

import pytest

from hf_dp import accounting
from hf_dp.budget import PrivacyBudget
from hf_dp.privacy_plan import PrivacyPlan

PLAN = PrivacyPlan("uls", num_units=100, num_privacy_units=100, sample_rate=0.1, steps=50, noise_multiplier=1.0,
                   delta=1e-3, contribution_bound=None, effective_noise_multiplier=1.0)


def epsilon_after(steps: int) -> float:
    return accounting.epsilon(sample_rate=0.1, noise_multiplier=1.0, steps=steps, delta=1e-3)


def test_a_step_is_allowed_only_while_it_keeps_epsilon_within_the_target(caplog):
    budget = PrivacyBudget(PLAN, target_epsilon=(epsilon_after(3) + epsilon_after(4)) / 2)
    assert [budget.allows(step) for step in range(5)] == [True, True, True, False, False]
    assert budget.record_step() and budget.record_step()  # after 2 steps a third still fits
    with caplog.at_level(logging.WARNING, logger="hf_dp.budget"):
        assert not budget.record_step()  # after 3, a fourth would not: training stops
    assert "one more step would spend" in caplog.text
    assert budget.steps == 3 and budget.epsilon() == pytest.approx(epsilon_after(3), rel=1e-9)
    assert budget.epsilon() <= budget.target_epsilon
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_dp.budget"):
        assert not budget.allows(3)  # the sampler asks before drawing step 4
    assert "no step taken" in caplog.text


def test_without_a_target_or_with_a_plan_that_fits_every_step_is_allowed(monkeypatch):
    free = PrivacyBudget(PLAN, target_epsilon=None)
    assert all(free.allows(step) for step in range(200)) and free.record_step()
    roomy = PrivacyBudget(PLAN, target_epsilon=epsilon_after(50) + 0.01)
    calls = []
    real = roomy.accountant.epsilon_after
    monkeypatch.setattr(roomy.accountant, "epsilon_after", lambda *a, **k: calls.append(k) or real(*a, **k))
    assert all(roomy.allows(step) for step in range(50))
    assert all(roomy.record_step() for _ in range(10))
    assert len(calls) == 1  # one accounting of the whole plan, not one per step


def test_the_choice_of_g_is_spent_before_the_first_step_and_composed_with_the_steps():
    budget = PrivacyBudget(PLAN, target_epsilon=8.0, bound_epsilon=0.1)
    assert budget.accountant.pure_dp == [{"label": "contribution_bound", "epsilon": 0.1}]
    assert budget.bound_epsilon == 0.1
    assert budget.epsilon() == 0.1 and budget.epsilon_bounds() == (0.1, 0.1, 0.1)
    budget.record_step()
    assert budget.epsilon() == pytest.approx(epsilon_after(1) + 0.1, rel=1e-9)
    lower, estimate, upper = budget.epsilon_bounds()
    assert lower <= estimate <= upper == budget.epsilon()
    assert PrivacyBudget(PLAN, 8.0).bound_epsilon == 0 and PrivacyBudget(PLAN, 8.0).epsilon() == 0


def test_a_restored_ledger_continues_and_is_checked_against_the_target():
    saved = accounting.PrivacyAccountant()
    saved.step(sample_rate=0.1, noise_multiplier=1.0, steps=3)
    budget = PrivacyBudget(PLAN, target_epsilon=(epsilon_after(3) + epsilon_after(4)) / 2)
    assert budget.allows(3) is False  # already decided once: after the restore it must be asked again
    budget.restore(saved)
    assert budget.steps == 3 and budget.epsilon() == pytest.approx(epsilon_after(3), rel=1e-9)
    assert budget.allows(2) and not budget.allows(3)  # the restored steps count
    saved.step(sample_rate=0.1, noise_multiplier=1.0)
    assert budget.steps == 3  # a copy, not the checkpoint's object
    other = PrivacyPlan(**{**PLAN.__dict__, "effective_noise_multiplier": 50.0})
    budget.replan(other)
    assert budget.plan is other and budget.allows(3)  # far more noise: the next step fits
