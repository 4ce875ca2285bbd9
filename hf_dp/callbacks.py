"""Trainer callbacks of DP training: ε on the progress bar."""

from __future__ import annotations

from transformers.trainer_callback import ProgressCallback, TrainerCallback


class PrivacyProgress(TrainerCallback):
    """Shows ε spent and σ on Trainer's progress bar (never the sampled batch size: it is data-dependent)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.epsilon = 0.0

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self.trainer
        bar = next((cb.training_bar for cb in trainer.callback_handler.callbacks
                    if isinstance(cb, ProgressCallback) and cb.training_bar is not None), None)
        if bar is None:
            return
        plan = trainer.privacy_plan
        every = max(1, plan.steps // 50)  # ε is computed every 2 % of the run, not every step
        if state.global_step % every == 0 or state.global_step == plan.steps:
            self.epsilon = trainer.current_epsilon()
        bar.set_postfix(eps=f"{self.epsilon:.3g}", sigma=f"{plan.noise_multiplier:.3g}", refresh=False)
