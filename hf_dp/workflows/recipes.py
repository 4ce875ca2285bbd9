"""What the scripts in `recipes/` share: their common flags, the run those flags describe, the line they print.

A recipe parses [`RecipeArguments`] (data, model, reporting) beside [`~hf_dp.DPTrainingArguments`] (every
training and privacy flag) with [`~hf_dp.command_line.ArgumentParser`], turns them into a task's run config and training
arguments with [`recipe_run`], runs the task, and prints [`summary_line`]; [`run_recipe`] is its `__main__`. Bad
numbers (a count below 1) are refused when the flags are parsed; bad data (a missing or empty file, rows without
a user id or text) when it is loaded, before any model is built or anything trained: one line naming the option
and the fix, status 2.
"""

from __future__ import annotations

import dataclasses
import traceback
from pathlib import Path
from typing import Callable, ClassVar

from hf_dp.formatting import format_epsilon, format_significant
from hf_dp.command_line import ArgumentParser, check_numbers, run_command
from hf_dp.vocabulary import MECHANISMS
from hf_dp.workflows.runs import RunConfig, finish_processes, plain_training_arguments

__all__ = ["RecipeArguments", "recipe_run", "run_recipe", "summary_line"]


@dataclasses.dataclass
class RecipeArguments:
    """Data, model and reporting flags every recipe shares.

    Training flags, the privacy ones and `--user_id_column` included, are [`~hf_dp.DPTrainingArguments`]'s: the
    recipes parse both, and [`recipe_run`] takes the user column from there.
    """

    dataset: str = dataclasses.field(
        default="shakespeare",
        metadata={"help": "'shakespeare' (speeches by speaking role, the embedded user-partitioned corpus) or a "
                          "JSONL/CSV/Parquet path or Hub dataset id (its user column: --user_id_column)."},
    )
    eval_dataset: str | None = dataclasses.field(
        default=None,
        metadata={"help": "Test data (other users than --dataset). Default: a seeded 20%% of the users of "
                          "--dataset, held out."},
    )
    text_column: str = dataclasses.field(default="text", metadata={"help": "Column with the text."})
    use_lora: bool = dataclasses.field(default=False,
                                       metadata={"help": "Train LoRA adapters instead of all weights."})
    lora_r: int = dataclasses.field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: int = dataclasses.field(default=16, metadata={"help": "LoRA alpha."})
    lora_target_modules: list[str] | None = dataclasses.field(
        default=None, metadata={"help": "Modules to adapt (default: peft's choice for the architecture)."}
    )
    non_private: bool = dataclasses.field(
        default=False,
        metadata={"help": "Train without DP (plain transformers.Trainer; privacy flags ignored), for comparison."},
    )
    results_dir: str = dataclasses.field(default="results", metadata={"help": "Where <run>.json is written."})
    max_train_users: int | None = dataclasses.field(
        default=None,
        metadata={"help": "Train on a seeded fixed-size sample of this many users (one user in can displace another: "
                          "the result and the card state it)."})
    max_eval_examples: int | None = dataclasses.field(default=None,
                                                      metadata={"help": "Evaluate on a seeded sample of rows."})

    # The checks of the run config the flags fill (a recipe sets its task's config class's).
    NUMBER_RULES: ClassVar[dict] = RunConfig.NUMBER_RULES

    def __post_init__(self):
        check_numbers(self, {name: rule for name, rule in self.NUMBER_RULES.items() if hasattr(self, name)})


def recipe_run(config_class, script_args, training_args, **overrides):
    """The run config and training arguments a recipe's parsed flags describe.

    Flags that name a field of `config_class` are copied by name. The user column, run name, evaluation batch size,
    progress bars and seed come from the training arguments (`--user_id_column`, `--run_name` or `--output_dir`,
    `--per_device_eval_batch_size`, `--disable_tqdm`, `--seed`), which become plain `TrainingArguments` with
    `--non_private`; the privacy settings stay in the training arguments only. `overrides` replace fields whose
    flag needs converting (e.g. a JSON file's contents).
    """
    user_id_column = training_args.user_id_column  # the split by user, and a DP run's privacy unit
    if script_args.non_private:
        training_args = plain_training_arguments(training_args)
    names = {f.name for f in dataclasses.fields(config_class)}
    kwargs = {f.name: getattr(script_args, f.name) for f in dataclasses.fields(script_args) if f.name in names}
    kwargs.update(
        run=Path(training_args.run_name or training_args.output_dir).name,
        user_id_column=user_id_column,
        eval_batch_size=training_args.per_device_eval_batch_size,
        progress=not training_args.disable_tqdm,
        seed=training_args.seed,
    )
    kwargs.update(overrides)
    return config_class(**kwargs), training_args


def run_recipe(parser: ArgumentParser, main: Callable, argv=None) -> int:
    """A recipe's `__main__`: parse, run `main(script_args, training_args)`, end the processes; the exit status.

    Bad flags, bad data and other `ValueError` / `OSError` refusals print one line (`<script>: error: ...`) and
    return 2, before anything is trained; so does a `RuntimeError` raised inside accelerate (a configuration it
    cannot run on this machine, e.g. FSDP1's `sync_module_states` on a CPU).
    """
    def run(script_args, training_args) -> int:
        try:
            main(script_args, training_args)
        except RuntimeError as error:  # accelerate refusing its own configuration: one line, not a traceback
            frames = traceback.extract_tb(error.__traceback__)
            if not frames or "accelerate" not in Path(frames[-1].filename).parts:
                raise
            raise ValueError(f"the accelerate configuration cannot run here: {error} Check the --config_file given "
                             "to accelerate launch (recipes/configs/ holds working ones: cpu.yaml, gpu.yaml, "
                             "multi_gpu.yaml, fsdp.yaml).") from error
        finish_processes()
        return 0

    return run_command(parser, run, argv)


def summary_line(result: dict, metric_label: str, output_dir: str) -> str:
    """One line a recipe prints at the end: run, mechanism, ε, metric beside the public-only baseline."""
    epsilon = ("no DP" if result["epsilon"] is None else
               f"ε = {format_epsilon(result['epsilon'])}, δ = {format_significant(result['delta'], 3, up=True)}")
    return (f"{result['run']} ({MECHANISMS[result['mechanism']].label}, {epsilon}): {metric_label} "
            f"{result['eval_result']:.4g}; public-only baseline {result['baseline_result']:.4g}. Model and card: "
            f"{output_dir}")
