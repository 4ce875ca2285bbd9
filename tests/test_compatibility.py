"""hf_dp.compatibility: what DP training needs from the Trainer class, the model and the loss, refused in one line."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch
import transformers
from packaging.specifiers import SpecifierSet
from transformers import Trainer

from hf_dp.compatibility import (SUPPORTED_TRANSFORMERS, check_model, check_no_loss_override,
                                 check_per_example, check_trainer_hooks, version_supported)
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


# ---- the model and the loss -------------------------------------------------------------------------------------


def test_a_compiled_model_or_model_init_is_refused_and_a_plain_model_passes():
    model = torch.nn.Linear(2, 2)
    check_model(model, None)
    with pytest.raises(ValueError, match=r"model_init: .*pass model=model_init\(\) instead") as error:
        check_model(None, lambda: model)
    one_line(error)
    with pytest.raises(ValueError, match=r"torch\.compile wrapper.*\(model\._orig_mod\)") as error:
        check_model(torch.compile(model), None)
    one_line(error)


def test_a_compute_loss_override_is_refused_in_any_subclass():
    class Custom(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return 0

    class Sub(Custom):
        pass

    check_no_loss_override(Trainer)
    with pytest.raises(ValueError, match=r"Custom overrides compute_loss \(in Custom\).*compute_loss_func=f"):
        check_no_loss_override(Custom)
    with pytest.raises(ValueError, match=r"Sub overrides compute_loss \(in Custom\)"):
        check_no_loss_override(Sub)
    check_no_loss_override(Sub, known=(Custom,))  # a DP trainer that reproduces Custom's loss per example


def test_a_loss_function_must_return_one_loss_per_example():
    check_per_example(torch.zeros(4), 4)
    for losses, shown in [(torch.tensor(1.0), r"\(\)"), (torch.zeros(4, 3), r"\(4, 3\)"), (torch.zeros(3), r"\(3,\)"),
                          ([0.0] * 4, "list")]:
        with pytest.raises(ValueError, match=f"compute_loss_func returned {shown} for a batch of 4 examples"):
            check_per_example(losses, 4)


def test_the_supported_transformers_range():
    assert version_supported(transformers.__version__)
    assert version_supported("5.24.0") and version_supported("5.99.1")
    assert not version_supported("4.57.0") and not version_supported("6.0.0")


# ---- the label checks read the labels column through Arrow, as the row walk would decide -------------------------


def _row_walk_has_target(rows, start: int) -> bool:
    return any(token != -100 for row in rows if row for token in row[start:])


@pytest.mark.parametrize("start", [0, 1])
def test_token_labels_are_judged_through_arrow_as_by_the_row_walk(start):
    """Many blocks of rows (the block is 7 rows here), nulls, empty rows, a selection that keeps or drops the one row
    with a target, a first-token-only target (no target for a causal LM): each answer is the row walk's."""
    from datasets import Dataset

    from hf_dp.compatibility import _token_targets
    from hf_dp.user_column import table_column

    masked = [[-100, -100, -100]] * 40 + [None, [], [-100]]
    cases = {"none": masked, "late": masked + [[-100, -100, 5]], "first token only": masked + [[7, -100]],
             "null token": masked + [[-100, None]]}
    for name, rows in cases.items():
        data = Dataset.from_dict({"labels": rows})
        for view in (data, data.select(range(len(rows) - 1)), data.shuffle(seed=0), data.select([len(rows) - 1, 3])):
            expected = _row_walk_has_target(view["labels"], start)
            assert _token_targets(*table_column(view, "labels"), start=start, block=7) == expected, (name, start)
    assert _token_targets(*table_column(Dataset.from_dict({"labels": cases["late"]}), "labels"), start=1, block=7)


def test_the_label_checks_refuse_through_arrow_what_they_refused_row_by_row():
    from datasets import Dataset

    from hf_dp.compatibility import check_class_labels, check_labels
    from trainer_fixtures import tiny_bert, tiny_llama

    only_first = Dataset.from_dict({"labels": [[5, -100, -100]] * 300})
    check_labels(only_first, tiny_bert())  # a token classifier learns from the first token
    with pytest.raises(ValueError, match="only the first token of a row, which a causal LM never predicts"):
        check_labels(only_first, tiny_llama())
    late = Dataset.from_dict({"labels": [[-100, -100]] * 70000 + [[-100, 4]]})
    check_labels(late, tiny_llama())  # the target in the last row, past the first block
    with pytest.raises(ValueError, match="No label in the training data is a target"):
        check_labels(late.select(range(70000)), tiny_llama())
    classes = Dataset.from_dict({"labels": [0, 1, None, 2, 7, -1] * 3})
    with pytest.raises(ValueError, match=r"^6 class label\(s\) outside 0..2 \(e.g. 7\)"):
        check_class_labels(classes, 3)
    check_class_labels(classes.select([0, 1, 2, 3]), 3)  # the selection holds none of them
    with pytest.raises(ValueError, match=r"^1 class label\(s\) outside 0..2 \(e.g. -1\)"):
        check_class_labels(classes.select([5, 0]), 3)
    with pytest.raises(ValueError, match="The training labels are strings"):
        check_labels(Dataset.from_dict({"labels": [None, "spam"]}), tiny_bert())
