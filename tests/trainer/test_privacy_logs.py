"""Issue #10: every number hf_dp releases is covered by the ε it states.

Training logs are noised sums accounted with the gradient (one Gaussian mechanism, σ_eff); the user and example
counts are rounded and said not to be covered; the card rounds ε and δ up; `hf-dp publish` recomputes ε from the
ledger saved beside the card and refuses a card that claims less.
"""
from __future__ import annotations

import json
import math
import re

import pytest
import torch
from huggingface_hub.repocard import metadata_load
from transformers.trainer_callback import ProgressCallback

from app_fixtures import privacy_ledger, privacy_report
from hf_dp import DPTrainer, DPTrainingArguments, accounting
from hf_dp import callbacks
from hf_dp import releases as releases_module
from hf_dp.card import LEDGER_FILE, render_privacy_card, write_privacy_card
from hf_dp.hub import PrivacyCardError, check_privacy_card
from trainer_fixtures import pad_collator, tiny_bert, user_dataset

# What a DP training log may hold: public plan values, the noised releases, Trainer's bookkeeping.
ALLOWED_LOG_KEYS = {
    "loss", "dp/clipped_fraction", "dp/epsilon", "dp/delta", "dp/noise_multiplier", "dp/sample_rate",
    "learning_rate", "epoch", "step", "grad_norm", "train_runtime", "train_samples_per_second",
    "train_steps_per_second", "total_flos", "train_loss",
}


def make_trainer(tmp_path, model=None, dataset=None, **overrides) -> DPTrainer:
    settings = dict(
        output_dir=str(tmp_path / "out"), max_steps=4, expected_batch_size=8, per_device_train_batch_size=4,
        learning_rate=1e-2, target_epsilon=8.0, noise_seed=1234, report_to=[], logging_steps=1,
        save_strategy="no", use_cpu=True, disable_tqdm=True,
    )
    settings.update(overrides)
    return DPTrainer(model=model if model is not None else tiny_bert(), args=DPTrainingArguments(**settings),
                     train_dataset=dataset if dataset is not None else user_dataset(), data_collator=pad_collator)


# ---- 3. training logs ---------------------------------------------------------------------------


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


@pytest.mark.parametrize("sampling, group", [("uls", False), ("els", True)])
def test_ledger_composes_gradient_loss_and_count_as_one_gaussian(tmp_path, sampling, group):
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
    assert segment["noise_multiplier"] == pytest.approx(plan.effective_noise_multiplier, rel=1e-12)
    report = trainer.privacy_report()
    assert report["epsilon"] == pytest.approx(accounting.epsilon(
        sample_rate=plan.sample_rate, noise_multiplier=effective, steps=3, delta=plan.delta, group_size=group_size),
        rel=1e-6)
    assert report["epsilon"] <= 4.0
    assert report["logging_noise_multiplier"] == plan.logging_noise_multiplier and report["max_loss"] == 5.0


def test_a_fixed_noise_multiplier_is_the_gradient_noise_and_the_ledger_accounts_more(tmp_path):
    trainer = make_trainer(tmp_path, noise_multiplier=1.0, target_epsilon=None, logging_noise_ratio=2.0)
    plan = trainer.privacy_plan
    assert plan.noise_multiplier == 1.0 and plan.logging_noise_multiplier == 2.0
    assert plan.effective_noise_multiplier == pytest.approx((1 + 2 / 4) ** -0.5)


def test_exact_token_counts_are_refused(tmp_path):
    with pytest.raises(ValueError, match="include_num_input_tokens_seen"):
        make_trainer(tmp_path, include_num_input_tokens_seen=True)


@pytest.mark.parametrize("overrides", [{"max_loss": 0.0}, {"logging_noise_ratio": -1.0},
                                       {"logging_noise_ratio": float("inf")}])
def test_logging_arguments_are_validated(tmp_path, overrides):
    with pytest.raises(ValueError, match=next(iter(overrides))):
        DPTrainingArguments(output_dir=str(tmp_path), use_cpu=True, **overrides)


# ---- 4. counts -----------------------------------------------------------------------------------


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
    assert "**The size of the data.**" in text and "rounding is not a DP mechanism" in text


# ---- 5. rounding ---------------------------------------------------------------------------------


def test_every_stated_epsilon_and_delta_is_rounded_up(tmp_path):
    report = dict(privacy_report("els", 2.98712, 3.0), delta=4.16493e-5, epsilon_lower=2.96119,
                  epsilon_estimate=2.97412, epsilon_group_privacy=58.3121, sample_rate=0.0812345,
                  noise_multiplier=1.23456)
    path = write_privacy_card(report, tmp_path, base_model="m")
    text = path.read_text(encoding="utf-8")
    assert "**(2.99, 4.17e-05)-differential privacy" in text and "4.16e-05" not in text
    assert "| δ (`delta`) | 4.17e-05 |" in text
    assert "between\n2.961 (lower bound) and 2.988 (upper bound)" in text  # interval rounded outwards
    assert "estimate 2.975" in text and "**ε = 58.32**" in text
    assert "| Sample rate q (`sample_rate`) | 0.08124 |" in text  # q up, σ down: never flattering
    assert "| Noise multiplier σ (`noise_multiplier`) | 1.234 |" in text
    privacy = metadata_load(path)["privacy"]  # the front matter keeps the exact values
    for key in ("epsilon", "delta", "epsilon_lower", "epsilon_estimate", "epsilon_group_privacy"):
        assert privacy[key] == report[key]


# ---- 12. publish checks the card against the ledger -----------------------------------------------


@pytest.fixture
def card_dir(tmp_path):
    report = privacy_report("uls", 7.9, 8.0)
    folder = tmp_path / "model"
    write_privacy_card(report, folder, ledger=privacy_ledger(report), base_model="test/tiny")
    return folder


def _edit_front_matter(folder, key, value):
    readme = folder / "README.md"
    text, count = re.subn(rf"(?m)^  {key}: .*$", f"  {key}: {value}", readme.read_text(encoding="utf-8"))
    assert count == 1
    readme.write_text(text, encoding="utf-8")


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("epsilon", "0.01", "claims ε = 0.01 but its ledger accounts ε = 3.16"),
        ("epsilon", "-5", "not a finite number"),
        ("epsilon", ".nan", "not a finite number"),
        ("epsilon", "true", "not a number"),
        ("delta", "0.9", "δ = 0.9 but its ledger"),
        ("delta", "1.0e-06", "δ = 1e-06 but its ledger"),
        ("delta", "1.5", "not in \\(0, 1\\)"),
        ("privacy_unit", "example", "privacy_unit = 'example'"),
        ("mechanism", "els", "mechanism = 'els'"),
        ("steps", "4", "steps = 4"),
    ],
)
def test_publish_refuses_a_hand_edited_front_matter(card_dir, key, value, message):
    assert check_privacy_card(card_dir)["epsilon"] == 7.9
    _edit_front_matter(card_dir, key, value)
    with pytest.raises(PrivacyCardError, match=message) as error:
        check_privacy_card(card_dir)
    assert "\n" not in str(error.value)


def test_publish_refuses_a_hand_edited_text(card_dir):
    readme = card_dir / "README.md"
    original = readme.read_text(encoding="utf-8")
    assert "**(7.90, 1e-05)-differential privacy" in original
    readme.write_text(original.replace("**(7.90, 1e-05)", "**(0.01, 1e-05)"), encoding="utf-8")
    with pytest.raises(PrivacyCardError, match=r"states \(0.01, 1e-05\)"):
        check_privacy_card(card_dir)
    readme.write_text(original.replace("| δ (`delta`) | 1e-05 |", "| δ (`delta`) | 1e-09 |"), encoding="utf-8")
    with pytest.raises(PrivacyCardError, match="its text states"):
        check_privacy_card(card_dir)


def test_publish_refuses_a_card_without_its_ledger(card_dir):
    (card_dir / LEDGER_FILE).unlink()
    with pytest.raises(PrivacyCardError, match="dp_ledger.json does not exist"):
        check_privacy_card(card_dir)
    (card_dir / LEDGER_FILE).write_text('{"format": 1, "delta": 1e-05}')
    with pytest.raises(PrivacyCardError, match="not a ledger written by hf_dp"):
        check_privacy_card(card_dir)


def test_publish_refuses_a_ledger_that_spent_more_than_the_card_says(card_dir):
    report = privacy_report("uls", 7.9, 8.0)
    greedy = privacy_ledger(dict(report, noise_multiplier=0.5))  # same steps, far more ε than 7.9
    (card_dir / LEDGER_FILE).write_text(json.dumps(greedy))
    with pytest.raises(PrivacyCardError, match="understated"):
        check_privacy_card(card_dir)


def test_trainer_saves_the_ledger_with_the_card_and_publish_accepts_it(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=2)
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
