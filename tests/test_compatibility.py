"""hf_dp.compatibility: what DP training needs from the Trainer class, the model and the loss, refused in one line."""

from __future__ import annotations

import tomllib
from pathlib import Path

import transformers
from packaging.specifiers import SpecifierSet
from transformers import Trainer
import pytest

from hf_dp.compatibility import SUPPORTED_TRANSFORMERS, check_trainer_hooks
from trainer_fixtures import one_line

ROOT = Path(__file__).resolve().parents[1]


# ---- the Trainer hooks the DP mixin relies on ---------------------------------------------------------------------


def test_the_installed_trainer_has_every_hook():
    check_trainer_hooks(Trainer)


def test_a_trainer_without_a_hook_is_refused_naming_the_supported_range():
    class OldTrainer:  # what a transformers before the hooks looked like: global clipping inline in the loop
        def _get_grad_norm(self, model, grad_norm=None):
            return None

        def _get_num_items_in_batch(self, batch_samples, device):
            return None

        def _remove_unused_columns(self, dataset, description=None):
            return dataset

    with pytest.raises(RuntimeError, match=r"_clip_grad_norm is missing") as error:
        check_trainer_hooks(OldTrainer)
    message = one_line(error)
    assert f"transformers{SUPPORTED_TRANSFORMERS}" in message and transformers.__version__ in message


def test_a_trainer_that_no_longer_calls_a_hook_is_refused():
    class RenamedCallsTrainer:  # the hooks exist but the training loop does not go through them
        def _clip_grad_norm(self, model):
            return None

        def _get_grad_norm(self, model, grad_norm=None):
            return None

        def _get_num_items_in_batch(self, batch_samples, device):
            return None

        def _remove_unused_columns(self, dataset, description=None):
            return dataset

    with pytest.raises(RuntimeError, match="never calls _clip_grad_norm"):
        check_trainer_hooks(RenamedCallsTrainer)


def test_pyproject_declares_the_tested_transformers_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    declared = [d for d in project["dependencies"] if d.startswith("transformers")]
    assert declared == [f"transformers{SUPPORTED_TRANSFORMERS}"]
    assert SpecifierSet(SUPPORTED_TRANSFORMERS).contains(transformers.__version__, prereleases=True), (
        f"transformers {transformers.__version__} is outside the declared transformers{SUPPORTED_TRANSFORMERS}")
