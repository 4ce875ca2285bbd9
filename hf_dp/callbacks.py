"""Trainer callbacks of DP training: ε on the progress bar."""

from __future__ import annotations

from transformers.trainer_callback import ProgressCallback, TrainerCallback

from .formatting import format_epsilon


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
        bar.set_postfix(eps=format_epsilon(self.epsilon), sigma=f"{plan.noise_multiplier:.3g}", refresh=False)


class AgreedJITCheckpoint(TrainerCallback):
    """Just-in-time saves (`enable_jit_checkpoint`) on several ranks: every rank saves at the same step, or none.

    Transformers' callback lets each rank act on its own SIGTERM at the first of three points it reaches, so two
    ranks can save different steps into one sharded checkpoint. Here the ranks agree once per step, after the
    optimizer step (one all-reduce of a flag, so one host sync a step, only with `enable_jit_checkpoint` on several
    ranks): as soon as any rank has been asked to stop, all save that step and stop.
    """

    def __init__(self, manager, device):
        self.manager, self.device = manager, device

    def on_step_end(self, args, state, control, **kwargs):
        import torch
        import torch.distributed as dist

        flag = torch.tensor([float(self.manager.is_checkpoint_requested)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            control.should_save = False
            control.should_training_stop = True
            self.manager.execute_jit_checkpoint()

    def on_train_end(self, args, state, control, **kwargs):
        """Give SIGTERM back to its handler from before training, as transformers' callback does."""
        import signal

        if self.manager._original_sigterm_handler is not None:
            signal.signal(signal.SIGTERM, self.manager._original_sigterm_handler)


def agree_on_jit_saves(trainer) -> None:
    """Replace transformers' per-rank just-in-time save callback by [`AgreedJITCheckpoint`] on several ranks."""
    from transformers.trainer_jit_checkpoint import JITCheckpointCallback

    if not trainer.args.enable_jit_checkpoint or trainer.args.world_size < 2:
        return
    for callback in list(trainer.callback_handler.callbacks):
        if isinstance(callback, JITCheckpointCallback) and callback.jit_manager is not None:
            trainer.callback_handler.remove_callback(callback)
            trainer.add_callback(AgreedJITCheckpoint(callback.jit_manager, trainer.args.device))
