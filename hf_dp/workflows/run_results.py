"""A run's result: the dict every run returns and writes as `<results_dir>/<run>.json`, and how it is read back.

Keys [`RESULT_KEYS`] (schema in [`hf_dp.workflows.tasks.classification`]'s docstring); the Gradio app and the study
([`hf_dp.workflows.study`]) read these files. A result's `config` records the run config and the training
arguments the run used, each under its own name. Writing is atomic and done by the main process only, so a
resumed study never reads half a file. Post-processing: nothing here affects ε.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from pathlib import Path
from typing import Mapping

import numpy as np

from hf_dp.workflows.runs import RunConfig, is_main_process, mechanism_of_arguments, privacy_fields

__all__ = [
    "RESULT_KEYS",
    "baseline_record",
    "load_result",
    "relative_path",
    "result_record",
    "run_config_record",
    "save_result",
    "training_summary",
]

# Keys every result JSON has (the Gradio app and the study rely on them); `non_private_result` is added when known.
RESULT_KEYS = (
    "run", "mechanism", "target_epsilon", "epsilon", "delta", "privacy", "metric_name", "eval_result",
    "baseline_result", "model_dir", "base_model", "task", "train_seconds", "eval_seconds", "config",
)


# Result keys that hold numbers (`eval_result` and `baseline_result` always; the others a number or null).
_NUMBER_KEYS = ("eval_result", "baseline_result", "non_private_result", "epsilon", "delta", "target_epsilon",
                "train_seconds", "eval_seconds")

# The TrainingArguments fields a result records (besides every field DPTrainingArguments adds).
_TRAINING_KEYS = (
    "learning_rate", "num_train_epochs", "max_steps", "per_device_train_batch_size", "lr_scheduler_type",
    "warmup_steps", "weight_decay", "seed", "max_grad_norm",
)


def training_summary(training_args) -> dict:
    """The values of `training_args` a result records: the optimisation fields above and, for
    [`~hf_dp.DPTrainingArguments`], every privacy field under its own name (`sampling` is `None` at the example
    level, where it is unused, as in the privacy report)."""
    keys = list(_TRAINING_KEYS)
    if mechanism_of_arguments(training_args) != "non-private":
        keys += sorted(privacy_fields())
    out = {}
    for key in keys:
        if hasattr(training_args, key):
            value = getattr(training_args, key)
            out[key] = value if isinstance(value, (int, float, str, type(None))) else str(value)
    if out.get("privacy_unit") == "example":
        out["sampling"] = None
    return out


def run_config_record(config: RunConfig, training_args=None) -> dict:
    """A result's `config`: the run config's fields and the training arguments' values the run used, each under
    its own name (so `config["target_epsilon"]` is what the trainer was given). When the run trained with another
    seed than the config's (which seeded the split), the config's is kept as `split_seed`."""
    record = config.to_dict()
    if training_args is None:
        return record
    summary = training_summary(training_args)
    if summary.get("seed", record["seed"]) != record["seed"]:
        record["split_seed"] = record["seed"]
    record.update(summary)
    return record


def relative_path(path, root) -> str:
    """`path` relative to `root` (results stay valid when the results folder moves)."""
    try:
        return os.path.relpath(Path(path).resolve(), Path(root).resolve())
    except ValueError:  # another drive on Windows
        return str(path)


def save_result(result: Mapping, results_dir) -> Path:
    """Write `results_dir/<run>.json` atomically (a resumed study never reads half a file); main process only."""
    folder = Path(results_dir)
    path = folder / f"{result['run']}.json"
    if not is_main_process():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_jsonable(result), indent=2) + "\n")
    os.replace(tmp, path)
    return path


def load_result(path) -> dict | None:
    """A result JSON, or `None` when it is missing or not a complete result (e.g. an interrupted write).

    Raises:
        ValueError: a complete-looking result whose figure is not a number (e.g. `"eval_result": "high"`), naming
            the file and the key.
    """
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(result, dict) or any(key not in result for key in RESULT_KEYS):
        return None
    for key in _NUMBER_KEYS:
        value = result.get(key)
        optional = key not in ("eval_result", "baseline_result")
        if (value is None and not optional) or (value is not None and (
                isinstance(value, bool) or not isinstance(value, numbers.Real))):
            raise ValueError(f"{path}: {key} is {value!r}, not a number: a result JSON is written by the run; "
                             "fix the value, or delete the file to run it again.")
    return result


def _jsonable(value):
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, (np.floating, float)):
        value = float(value)
        if not math.isfinite(value):
            return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
        return value
    if isinstance(value, Path):
        return str(value)
    return value


def baseline_record(config: RunConfig, *, task: str, metric_name: str, eval_result: float, base_model: str,
                    eval_seconds: float, description: str, config_extra: Mapping | None = None, **extra) -> dict:
    """The result dict of a public-only baseline (keys [`RESULT_KEYS`]): no private data, so ε = δ = 0, no privacy
    report and no model folder (the model is the base model itself); `description` says what the baseline is."""
    return {
        "run": config.run, "mechanism": "public-only", "target_epsilon": None, "epsilon": 0.0, "delta": 0.0,
        "privacy": None, "metric_name": metric_name, "eval_result": float(eval_result),
        "baseline_result": float(eval_result), "model_dir": None, "base_model": base_model, "task": task,
        "train_seconds": 0.0, "eval_seconds": float(eval_seconds), **extra,
        "config": {**run_config_record(config), **(config_extra or {}), "baseline": description},
    }


def result_record(config: RunConfig, *, training_args, privacy: dict | None, task: str, metric_name: str,
                  eval_result: float, baseline_result: float, model_dir, base_model: str, train_seconds: float,
                  eval_seconds: float, **extra) -> dict:
    """The result dict of a fine-tuning run (keys [`RESULT_KEYS`], schema in [`hf_dp.workflows.tasks.classification`]),
    with `non_private_result` when the config knows it."""
    result = {
        "run": config.run,
        "mechanism": mechanism_of_arguments(training_args),
        "target_epsilon": None if privacy is None else privacy.get("target_epsilon"),
        "epsilon": None if privacy is None else privacy["epsilon"],
        "delta": None if privacy is None else privacy["delta"],
        "privacy": privacy,
        "metric_name": metric_name,
        "eval_result": float(eval_result),
        "baseline_result": float(baseline_result),
    }
    if config.non_private_result is not None:
        result["non_private_result"] = float(config.non_private_result)
    result.update({
        "model_dir": relative_path(model_dir, config.results_dir),
        "base_model": base_model,
        "task": task,
        "train_seconds": float(train_seconds),
        "eval_seconds": float(eval_seconds),
        **extra,
        "config": run_config_record(config, training_args),
    })
    return result
