"""A steady-state DP step runs its stages only: what a new model needs (the parameters' names, the probe, the
clipper's model and row checks) is done once, by `DPStep.prepare`, and again only when the model changes."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
from transformers import TrainerCallback

import hf_dp
from trainer_fixtures import make_trainer, one_line

PACKAGE = str(Path(hf_dp.__file__).parent) + "/"
# Entered only when the model is new or changed (step 1 here), never in a steady-state step.
PREPARE_ONLY = {"step.py:prepare", "batch_independence.py:check_batch_independence", "sharding.py:check_sharded",
                "clipping/engine.py:check_model", "clipping/attach.py:check_gradient_checkpointing",
                "clipping/rows.py:check_rows", "clipping/attribution.py:coverage_params",
                "clipping/attribution.py:verify_rows", "clipping/attribution.py:verify_coverage"}


def entered_by_step(trainer) -> list[dict]:
    """Per `training_step`: the hf_dp files entered (paths in the package) and the functions entered, `file:name`."""
    steps, original = [], trainer.training_step

    def profiled(*args, **kwargs):
        files, functions = set(), set()

        def profile(frame, event, arg):
            path = frame.f_code.co_filename
            if event == "call" and path.startswith(PACKAGE):
                files.add(path[len(PACKAGE):])
                functions.add(f"{path[len(PACKAGE):]}:{frame.f_code.co_name}")

        sys.setprofile(profile)
        try:
            return original(*args, **kwargs)
        finally:
            sys.setprofile(None)
            steps.append({"files": files, "functions": functions})

    trainer.training_step = profiled
    trainer.train()
    return steps


def test_a_steady_state_step_enters_few_files_and_no_first_step_check(tmp_path):
    steps = entered_by_step(make_trainer(tmp_path, max_steps=3))
    first, steady = steps[0], steps[2]
    assert PREPARE_ONLY & first["functions"] >= {"step.py:prepare", "batch_independence.py:check_batch_independence",
                                                 "clipping/engine.py:check_model"}
    assert not PREPARE_ONLY & steady["functions"], sorted(PREPARE_ONLY & steady["functions"])
    outside_clipping = sorted(path for path in steady["files"] if not path.startswith("clipping/"))
    assert len(outside_clipping) <= 12, outside_clipping


def _mix(module, args, output):
    """Adds 2·sin(B) to the output, B the batch's rows: every user moves every other's output."""
    return output + 2 * math.sin(output.shape[0])


def _hook_on_the_classifier(model):
    return model.classifier.register_forward_hook(_mix)


def _global_hook(model):
    """Every module's output (torch's global hook): the classifier's mixes the rows, the others keep theirs."""
    from torch.nn.modules.module import register_module_forward_hook

    return register_module_forward_hook(lambda module, args, output: _mix(module, args, output)
                                        if module is model.classifier else None)


def _forward_replaced(model):
    forward = model.classifier.forward
    model.classifier.forward = lambda *args, **kwargs: _mix(None, args, forward(*args, **kwargs))


class _MixAfterFirstStep(TrainerCallback):
    """After step 1, something that mixes the batch: a hook, a global hook or a replaced forward."""

    def __init__(self, change):
        self.change, self.handle = change, None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 1:
            self.handle = self.change(model)


@pytest.mark.parametrize("change", [_hook_on_the_classifier, _global_hook, _forward_replaced],
                         ids=["module-hook", "global-hook", "forward-replaced"])
def test_a_hook_attached_after_the_first_step_is_probed_before_the_next(tmp_path, change):
    trainer = make_trainer(tmp_path, max_steps=3)
    mix = _MixAfterFirstStep(change)
    trainer.add_callback(mix)
    try:
        with pytest.raises(ValueError, match="another output alone than in a batch of 3 rows") as error:
            trainer.train()
    finally:
        if mix.handle is not None:
            mix.handle.remove()  # a global hook would outlive the test
    one_line(error)
    assert trainer.accountant.steps == 1  # refused before the second step's ledger entry
