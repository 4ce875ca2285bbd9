"""hf_dp.callbacks: ε and σ on the progress bar (computed every 2 % of the run), the ledger in every checkpoint."""
from __future__ import annotations

from types import SimpleNamespace

from transformers.trainer_callback import ProgressCallback

from hf_dp.callbacks import PrivacyProgress


class Bar:
    def __init__(self):
        self.postfixes = []

    def set_postfix(self, **postfix):
        self.postfixes.append(postfix)


class FakeTrainer:
    """What the callbacks read: the callbacks, the plan, ε so far, and where the ledger is saved."""

    def __init__(self, steps=100, bar=None):
        progress = ProgressCallback()
        progress.training_bar = bar
        self.callback_handler = SimpleNamespace(callbacks=[progress])
        self.privacy_plan = SimpleNamespace(steps=steps, noise_multiplier=1.23456)
        self.epsilon_calls, self.saved = [], []

    def current_epsilon(self):
        self.epsilon_calls.append(len(self.epsilon_calls))
        return 0.5 + 0.01 * len(self.epsilon_calls)

    def save_privacy_state(self, folder):
        self.saved.append(folder)


def test_the_progress_bar_shows_epsilon_computed_every_two_percent_and_sigma():
    bar = Bar()
    trainer = FakeTrainer(steps=100, bar=bar)
    callback = PrivacyProgress(trainer)
    for step in range(1, 101):
        callback.on_step_end(None, SimpleNamespace(global_step=step), None)
    assert len(trainer.epsilon_calls) == 50  # every 2 steps of 100, the last included: not every step
    assert len(bar.postfixes) == 100
    assert bar.postfixes[0] == {"eps": "0.00", "sigma": "1.23", "refresh": False}  # step 1: none computed yet
    assert bar.postfixes[-1] == {"eps": "1.00", "sigma": "1.23", "refresh": False}  # 0.5 + 0.01 · 50, rounded up
    assert all(set(postfix) == {"eps", "sigma", "refresh"} for postfix in bar.postfixes)  # never a sampled size
    short = FakeTrainer(steps=7, bar=Bar())
    for step in range(1, 8):
        PrivacyProgress(short).on_step_end(None, SimpleNamespace(global_step=step), None)
    assert len(short.epsilon_calls) == 7  # a short run: every step


def test_without_a_progress_bar_nothing_is_computed():
    trainer = FakeTrainer(bar=None)
    PrivacyProgress(trainer).on_step_end(None, SimpleNamespace(global_step=2), None)
    assert trainer.epsilon_calls == []
