"""hf_dp.arguments: DPTrainingArguments refuses a bad privacy field at construction, in one line naming it (a line per
field when several are wrong), normalises the fields it can, and every field is a command-line flag."""

from __future__ import annotations

import math

import pytest
from transformers import HfArgumentParser

from hf_dp import DPTrainingArguments
from trainer_fixtures import make_args, one_line


# ---- a bad field is refused in one line naming it -----------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"privacy_unit": "row"}, "privacy_unit"),
        ({"sampling": "shuffle"}, "sampling"),
        ({"target_epsilon": -1.0}, "target_epsilon"),
        ({"target_epsilon": None}, "noise_multiplier"),
        ({"contribution_bound": "many"}, "contribution_bound"),
        ({"gradient_accumulation_steps": 4}, "expected_batch_size"),
        ({"max_grad_norm": 0.0}, "max_grad_norm"),
        ({"fp16": True}, "bf16"),
        ({"label_smoothing_factor": 0.1}, "label_smoothing_factor"),
        ({"fsdp": "full_shard", "fsdp_config": {"version": 1}}, "FSDP2 only"),
    ],
)
def test_argument_validation(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        make_args(tmp_path, **overrides)


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"max_grad_norm": math.inf}, "max_grad_norm"),
        ({"max_grad_norm": math.nan}, "max_grad_norm"),
        ({"max_grad_norm": -1.0}, "max_grad_norm"),
        ({"target_epsilon": math.inf}, "target_epsilon"),
        ({"target_epsilon": math.nan}, "target_epsilon"),
        ({"target_delta": math.nan}, "target_delta"),
        ({"target_delta": math.inf}, "target_delta"),
        ({"noise_multiplier": math.inf}, "noise_multiplier"),
        ({"noise_multiplier": math.nan}, "noise_multiplier"),
        ({"expected_batch_size": math.nan}, "expected_batch_size"),
        ({"expected_batch_size": 2.5}, "expected_batch_size"),
        ({"noise_seed": "abc"}, "noise_seed"),
        ({"noise_seed": 1.5}, "noise_seed"),
        ({"noise_seed": True}, "noise_seed"),
        ({"noise_seed": -1}, "noise_seed"),
    ],
)
def test_non_finite_or_malformed_settings_are_refused(tmp_path, overrides, field):
    with pytest.raises(ValueError, match=f"{field}="):
        make_args(tmp_path, **overrides)


def test_integral_float_batch_size_is_accepted(tmp_path):
    assert make_args(tmp_path, expected_batch_size=16.0).expected_batch_size == 16


@pytest.mark.parametrize("overrides", [{"max_loss": 0.0}, {"logging_noise_ratio": -1.0},
                                       {"logging_noise_ratio": float("inf")}])
def test_logging_arguments_are_validated(tmp_path, overrides):
    with pytest.raises(ValueError, match=next(iter(overrides))):
        DPTrainingArguments(output_dir=str(tmp_path), use_cpu=True, **overrides)


@pytest.mark.parametrize("overrides, message", [
    ({"target_unclipped_quantile": 1.0}, r"target_unclipped_quantile=1.0: must lie strictly between 0 and 1"),
    ({"target_unclipped_quantile": 0.0}, "target_unclipped_quantile"),
    ({"clipping_learning_rate": 0.0}, r"clipping_learning_rate=0.0: must be a finite number > 0"),
    ({"clipping_count_noise": -1.0}, r"clipping_count_noise=-1.0: must be a finite number > 0"),
    ({"clipping_count_noise": math.inf}, "clipping_count_noise"),
    ({"adaptive_clipping": "yes"}, "adaptive_clipping='yes': use True or False"),
    ({"torch_compile": True}, r"torch_compile=True .*pass an uncompiled model"),
    ({"torch_compile_mode": "default"}, r"torch_compile=True \(or a torch_compile_backend / torch_compile_mode"),
])
def test_arguments_are_validated_in_one_line(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message) as error:
        make_args(tmp_path, **overrides)
    assert "\n" not in str(error.value)


def test_bound_epsilon_arguments():
    with pytest.raises(ValueError, match="contribution_bound_epsilon"):
        DPTrainingArguments(output_dir="x", contribution_bound_epsilon=0.0, use_cpu=True)
    with pytest.raises(ValueError, match="leaves nothing"):
        DPTrainingArguments(output_dir="x", target_epsilon=0.1, contribution_bound_epsilon=0.1, use_cpu=True)
    DPTrainingArguments(output_dir="x", target_epsilon=0.1, contribution_bound=2, use_cpu=True)  # not spent


def test_els_without_a_contribution_bound_is_refused_at_construction(tmp_path):
    with pytest.raises(ValueError, match="contribution_bound=None with sampling='els'.*integer or 'auto'"):
        make_args(tmp_path, sampling="els", contribution_bound=None)
    make_args(tmp_path, sampling="uls", contribution_bound=None)  # ULS may keep every row
    make_args(tmp_path, privacy_unit="example", contribution_bound=None)


def test_uploading_checkpoints_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"hub_strategy='checkpoint'.*every_save") as error:
        make_args(tmp_path, push_to_hub=True, hub_strategy="checkpoint", hub_model_id="me/model")
    one_line(error)


def test_several_bad_fields_are_listed_one_per_line(tmp_path):
    with pytest.raises(ValueError) as error:
        make_args(tmp_path, noise_seed="abc", target_epsilon=math.inf)
    lines = str(error.value).splitlines()
    assert lines[0] == "Invalid DPTrainingArguments:" and len(lines) == 3


# ---- every field is a command-line flag ---------------------------------------------------------------------------


def test_arguments_are_cli_flags():
    parser = HfArgumentParser(DPTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(
        ["--output_dir", "x", "--target_epsilon", "3", "--sampling", "els", "--contribution_bound", "4",
         "--user_id_column", "author", "--use_cpu", "true"]
    )
    assert (args.target_epsilon, args.sampling, args.contribution_bound, args.user_id_column) == \
        (3.0, "els", 4, "author")
    help_text = parser.format_help()
    for flag in ["--target_delta", "--privacy_unit", "--expected_batch_size", "--noise_seed", "--noise_multiplier"]:
        assert flag in help_text


def test_adaptive_arguments_are_cli_flags():
    from transformers import HfArgumentParser

    from hf_dp import DPTrainingArguments

    parser = HfArgumentParser(DPTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(
        ["--output_dir", "x", "--use_cpu", "true", "--adaptive_clipping", "--target_unclipped_quantile", "0.7",
         "--clipping_learning_rate", "0.3", "--clipping_count_noise", "4"])
    assert (args.adaptive_clipping, args.target_unclipped_quantile, args.clipping_learning_rate,
            args.clipping_count_noise) == (True, 0.7, 0.3, 4.0)
    help_text = parser.format_help()
    for flag in ("--adaptive_clipping", "--target_unclipped_quantile", "--clipping_learning_rate",
                 "--clipping_count_noise"):
        assert flag in help_text


# ---- normalised fields, and fields set after construction -----------------------------------------------------------


@pytest.mark.parametrize("value, parsed", [("auto", "auto"), (4, 4), ("4", 4), (None, None)])
def test_the_contribution_bound_is_a_positive_integer_auto_or_none(tmp_path, value, parsed):
    assert make_args(tmp_path, contribution_bound=value).contribution_bound == parsed


@pytest.mark.parametrize("value", [0, -2, "4.5", 4.5, "four", "4 users"])
def test_any_other_contribution_bound_is_refused(tmp_path, value):
    with pytest.raises(ValueError, match=f"contribution_bound={value!r}: use a positive integer or 'auto'"):
        make_args(tmp_path, contribution_bound=value)


def test_a_field_set_after_construction_is_checked_again(tmp_path):
    args = make_args(tmp_path)
    args.validate_privacy_fields()  # valid: passes, again
    args.max_grad_norm = math.nan
    args.sampling = "shuffle"
    with pytest.raises(ValueError) as error:
        args.validate_privacy_fields()
    assert "max_grad_norm=nan" in str(error.value) and "sampling='shuffle'" in str(error.value)


@pytest.mark.parametrize("value", [0, -1, 2.5, True])
def test_a_micro_batch_size_must_be_a_positive_integer_or_unset(tmp_path, value):
    assert make_args(tmp_path, per_device_train_batch_size=None).per_device_train_batch_size is None
    with pytest.raises(ValueError, match=f"per_device_train_batch_size={value!r}"):
        make_args(tmp_path, per_device_train_batch_size=value)


@pytest.mark.parametrize("target_epsilon, target_delta, limit", [(1e6, None, "any δ (below 1/2) once ε > 104.9"),
                                                                 (100.0, 1e-5, "δ = 1e-05 once ε > 94.0")])
def test_an_epsilon_no_sampler_can_state_is_refused_at_construction(target_epsilon, target_delta, limit):
    """Beyond this ε even one noise draw adds more than 1% of δ: refused in one line, in words, not "δ = inf"."""
    with pytest.raises(ValueError, match="beyond what the noise sampler can state for any model") as error:
        DPTrainingArguments(output_dir="x", target_epsilon=target_epsilon, target_delta=target_delta, use_cpu=True)
    assert limit in str(error.value) and "= inf" not in str(error.value)
    assert DPTrainingArguments(output_dir="x", target_epsilon=90.0, use_cpu=True).target_epsilon == 90.0
