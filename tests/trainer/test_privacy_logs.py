"""What a DP run releases besides the model is covered by the ε it states.

Training logs are noised sums accounted with the gradient (one Gaussian release, σ_eff); nothing exact reaches
Trainer's state or progress bar; the user and example counts are rounded and said not to be covered; the card and
the ledger written beside the model are what `hf-dp publish` checks (tests/test_hub.py, tests/test_card.py).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers.trainer_callback import ProgressCallback

from hf_dp import accounting, callbacks
from hf_dp import releases as releases_module
from hf_dp.card import LEDGER_FILE, render_privacy_card
from hf_dp.hub import check_privacy_card
from trainer_fixtures import make_trainer, tiny_bert, user_dataset

# What a DP training log may hold: public plan values, the noised releases, Trainer's bookkeeping.
ALLOWED_LOG_KEYS = {
    "loss", "dp/clipped_fraction", "dp/epsilon", "dp/delta", "dp/noise_multiplier", "dp/sample_rate",
    "learning_rate", "epoch", "step", "grad_norm", "train_runtime", "train_samples_per_second",
    "train_steps_per_second", "total_flos", "train_loss",
}


# ---- training logs are noised, bounded sums -----------------------------------------------------------------------


@pytest.mark.parametrize("sampling", ["uls", "els"])
def test_logged_loss_is_a_bounded_noised_sum_even_for_an_outlier_user(tmp_path, monkeypatch, sampling):
    """A model that is confidently wrong has per-example losses in the hundreds: each unit still adds at most
    max_loss to the released sum, and `loss` is (that sum + N(0, (σ_log·max_loss)²)) / expected batch size."""
    model = tiny_bert()
    with torch.no_grad():
        model.classifier.weight.mul_(1e4)  # huge logits: losses of the wrong class far above max_loss
    trainer = make_trainer(tmp_path, model=model, sampling=sampling, contribution_bound=3, max_steps=6,
                           learning_rate=0.0, max_loss=2.0)
    plan = trainer.privacy_plan
    releases, sampled = [], []
    real_noise, real_step = releases_module.add_scalar_noise, trainer.training_step

    def recording_noise(values, stds, **kwargs):
        noised = real_noise(values, stds, **kwargs)
        releases.append(([float(v) for v in values], list(stds), [float(v) for v in noised]))
        return noised

    def recording_step(model, inputs, *args, **kwargs):
        sampled.append(inputs.total_units)
        return real_step(model, inputs, *args, **kwargs)

    monkeypatch.setattr(releases_module, "add_scalar_noise", recording_noise)
    monkeypatch.setattr(trainer, "training_step", recording_step)
    trainer.train()

    expected_batch = plan.sample_rate * plan.num_units
    logged = [e for e in trainer.state.log_history if "dp/epsilon" in e]
    assert len(releases) == len(logged) == 6
    for (values, stds, noised), units, entry in zip(releases, sampled, logged):
        loss_sum, clipped = values
        assert 0 <= loss_sum <= 2.0 * units + 1e-9  # one unit moves the sum by at most max_loss
        assert 0 <= clipped <= units
        assert stds == pytest.approx([plan.logging_noise_multiplier * 2.0, plan.logging_noise_multiplier])
        assert entry["loss"] == pytest.approx(noised[0] / expected_batch, rel=1e-6)
        assert entry["dp/clipped_fraction"] == pytest.approx(noised[1] / expected_batch, rel=1e-9)
        assert "dp/batch_units" not in entry
    assert max(values[0] for values, _, _ in releases) > 0  # the outliers were sampled and clipped, not dropped


def test_nothing_exact_reaches_trainer_state_or_the_progress_bar(tmp_path):
    trainer = make_trainer(tmp_path, save_strategy="steps", save_steps=2)
    trainer.train()
    state = json.loads((tmp_path / "out" / "checkpoint-4" / "trainer_state.json").read_text())
    keys = set().union(*(entry.keys() for entry in state["log_history"]))
    assert keys <= ALLOWED_LOG_KEYS, keys - ALLOWED_LOG_KEYS
    assert state["total_flos"] == 0 and state.get("num_input_tokens_seen", 0) == 0
    assert all(entry.get("grad_norm") is None for entry in state["log_history"])

    class Bar:
        def set_postfix(self, **postfix):
            self.postfix = postfix

    progress = ProgressCallback()
    progress.training_bar = Bar()
    trainer.add_callback(progress)
    privacy_progress = next(cb for cb in trainer.callback_handler.callbacks
                            if isinstance(cb, callbacks.PrivacyProgress))
    privacy_progress.on_step_end(trainer.args, trainer.state, trainer.control)
    assert set(progress.training_bar.postfix) == {"eps", "sigma", "refresh"}


def test_private_logging_off_logs_nothing_computed_from_the_data(tmp_path):
    trainer = make_trainer(tmp_path, private_logging=False)
    assert trainer.privacy_plan.logging_noise_multiplier is None
    assert trainer.privacy_plan.effective_noise_multiplier == trainer.privacy_plan.noise_multiplier
    trainer.train()
    keys = set().union(*(entry.keys() for entry in trainer.state.log_history))
    assert not keys & {"loss", "train_loss", "dp/clipped_fraction", "dp/batch_units"}
    assert {"dp/epsilon", "dp/delta", "dp/noise_multiplier", "dp/sample_rate"} <= keys


def test_exact_token_counts_are_refused(tmp_path):
    with pytest.raises(ValueError, match="include_num_input_tokens_seen"):
        make_trainer(tmp_path, include_num_input_tokens_seen=True)


# ---- the accountant composes the logs with the gradient -----------------------------------------------------------


@pytest.mark.parametrize("sampling, group", [("uls", False), ("els", True)])
def test_the_accountant_composes_gradient_loss_and_count_as_one_gaussian(tmp_path, sampling, group):
    trainer = make_trainer(tmp_path, sampling=sampling, contribution_bound=3, max_steps=3, target_epsilon=4.0)
    plan = trainer.privacy_plan
    ratio = trainer.args.logging_noise_ratio
    assert ratio == 10.0 and plan.logging_noise_multiplier == pytest.approx(ratio * plan.noise_multiplier)
    effective = (plan.noise_multiplier ** -2 + 2 * plan.logging_noise_multiplier ** -2) ** -0.5
    assert plan.effective_noise_multiplier == pytest.approx(effective, rel=1e-12)
    assert plan.noise_multiplier / plan.effective_noise_multiplier == pytest.approx(math.sqrt(1.02))  # ~1 % more
    group_size = plan.group_size if group else 1
    calibrated = accounting.noise_multiplier(target_epsilon=4.0, delta=plan.delta, sample_rate=plan.sample_rate,
                                             steps=plan.steps, group_size=group_size)
    assert plan.effective_noise_multiplier == pytest.approx(calibrated, rel=1e-12)
    trainer.train()
    (segment,) = trainer.accountant.history
    assert segment["effective_noise_multiplier"] == pytest.approx(plan.effective_noise_multiplier, rel=1e-12)
    report = trainer.privacy_report()
    assert report["epsilon"] == pytest.approx(accounting.epsilon(
        sample_rate=plan.sample_rate, noise_multiplier=effective, steps=3, delta=plan.delta, group_size=group_size),
        rel=1e-6)
    assert report["epsilon"] <= 4.0
    assert report["logging_noise_multiplier"] == plan.logging_noise_multiplier and report["max_loss"] == 5.0


def test_a_fixed_noise_multiplier_is_the_gradient_noise_and_the_accountant_composes_less(tmp_path):
    trainer = make_trainer(tmp_path, noise_multiplier=1.0, target_epsilon=None, logging_noise_ratio=2.0)
    plan = trainer.privacy_plan
    assert plan.noise_multiplier == 1.0 and plan.logging_noise_multiplier == 2.0
    assert plan.effective_noise_multiplier == pytest.approx((1 + 2 / 4) ** -0.5)


# ---- the card and the ledger written beside the model -------------------------------------------------------------


def test_counts_are_rounded_and_the_card_says_they_are_not_covered(tmp_path):
    trainer = make_trainer(tmp_path, dataset=user_dataset(num_users=123, max_rows=3), expected_batch_size=8)
    assert trainer.partition.num_users == 123
    report = trainer.privacy_report()
    assert report["num_users"] == 120
    assert report["num_examples"] == round(trainer.partition.num_examples, -1)  # 2 significant figures
    text = render_privacy_card(dict(report, num_users=1101, num_examples=14920), base_model="m").text
    assert "| Users trained on, rounded, not covered by ε (`num_users`) | 1,100 |" in text
    assert "| Examples trained on, rounded, not covered by ε (`num_examples`) | 15,000 |" in text
    assert "1101" not in text and "14920" not in text
    assert "**The size of the data.**" in text and "rounding is not differentially private" in text


def test_trainer_saves_the_ledger_with_the_card_and_publish_accepts_it(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=2, noise_seed=None)  # secret noise: a card publish accepts
    trainer.train()
    out = tmp_path / "out"
    ledger = json.loads((out / LEDGER_FILE).read_text())
    assert ledger["accountant"] == trainer.accountant.state_dict()
    assert ledger["delta"] == trainer.privacy_plan.delta
    assert (ledger["mechanism"], ledger["sampling"]) == ("uls", "uls")
    assert check_privacy_card(out)["epsilon"] == pytest.approx(trainer.privacy_report()["epsilon"])
    elsewhere = tmp_path / "models" / "run"  # what runs.save_run does when models are saved elsewhere
    trainer.write_privacy_card(str(elsewhere), eval_result=0.5)
    assert json.loads((elsewhere / LEDGER_FILE).read_text()) == ledger
    check_privacy_card(elsewhere)
