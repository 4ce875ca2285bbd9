"""What the study behind `hf-dp demo` runs: its list of runs, and the run config and training arguments of each.

[`plan_runs`] names the runs of a study (the demo's few, or the `--grid`), each a [`StudyRun`] (a mechanism, a
target ε, a fixed or an adaptive clipping norm); [`configure_run`] turns one into the task's run config and its
training arguments, from the settings of [`hf_dp.workflows.study_settings`]. [`hf_dp.workflows.study`] runs them.
"""

from __future__ import annotations

import dataclasses

from hf_dp.vocabulary import MECHANISMS
from hf_dp.workflows.study_settings import check_task

__all__ = ["StudyRun", "configure_run", "matching_examples_per_step", "plan_runs"]


@dataclasses.dataclass(frozen=True)
class StudyRun:
    """One entry of the study: a run name, its mechanism (a key of [`~hf_dp.vocabulary.MECHANISMS`]), target ε
    (`None`: non-private / public-only baseline) and whether the clipping norm is adaptive (the settings'
    `"adaptive"` fields on top of `"dp"`) or fixed."""

    run: str
    mechanism: str
    target_epsilon: float | None = None
    adaptive: bool = False


def plan_runs(grid: bool, task: str = "classification") -> list[StudyRun]:
    """The demo's runs, or the grid's (baseline and non-private first: their numbers go into the DP cards).

    Classification: ULS at ε = 8 with an adaptive clipping norm (grid: ULS and ELS at ε ∈ {8, 3, 1} and
    example-level at ε = 8, all adaptive, and ULS at ε = 8 with the fixed norm beside it). Causal LM: ULS at
    ε = 8 with a fixed and with an adaptive clipping norm (grid: ULS and ELS at ε ∈ {8, 3, 1}, each with a fixed
    and with an adaptive norm).
    """
    runs = [StudyRun("baseline", "public-only"), StudyRun("non-private", "non-private")]
    if check_task(task) == "causal_lm":
        pairs = [("uls", 8.0)] if not grid else [(m, float(e)) for m in ("uls", "els") for e in (8, 3, 1)]
        for key, eps in pairs:
            runs += [StudyRun(f"{key}-eps{eps:g}", key, eps), StudyRun(f"{key}-eps{eps:g}-adaptive", key, eps, True)]
        return runs
    demo = StudyRun("uls-eps8-adaptive", "uls", 8.0, True)
    if not grid:
        return runs + [demo]
    runs += [demo, StudyRun("uls-eps8", "uls", 8.0)]
    runs += [StudyRun(f"uls-eps{eps}-adaptive", "uls", float(eps), True) for eps in (3, 1)]
    runs += [StudyRun(f"els-eps{eps}-adaptive", "els", float(eps), True) for eps in (8, 3, 1)]
    return runs + [StudyRun("example-eps8-adaptive", "example", 8.0, True)]


def matching_examples_per_step(user_ids, users_per_step: int, contribution_bound: int) -> int:
    """Expected speeches per ULS step, `users_per_step x mean_u min(n_u, G)`: the ELS/example-level batch of equal
    compute. An exact statistic of the training data, released through the runs' `expected_batch_size`: fine for
    the study's public Shakespeare corpus; on private data use public numbers or a DP estimate instead."""
    import numpy as np
    from collections import Counter

    counts = np.array(list(Counter(user_ids).values()))
    return max(1, round(users_per_step * float(np.minimum(counts, contribution_bound).mean())))


def configure_run(entry: StudyRun, settings: dict, results_dir: str, *, examples_per_step: int, progress: bool = True,
                  baseline_result: float | None = None, non_private_result: float | None = None,
                  task: str = "classification"):
    """The run config and training arguments of one study run (`None` for the public-only baseline, which trains
    nothing). ELS and example-level DP-SGD sample `examples_per_step` examples per step
    ([`matching_examples_per_step`]), ULS `settings["dp"]["expected_batch_size"]` users; an adaptive entry adds
    `settings["adaptive"]` (`adaptive_clipping=True`, ...) to the DP fields.

    Raises:
        ValueError: an adaptive entry while [`~hf_dp.DPTrainingArguments`] has no `adaptive_clipping` field.
    """
    if check_task(task) == "causal_lm":
        from hf_dp.workflows.tasks.language_modeling import LanguageModelingConfig as config_class
    else:
        from hf_dp.workflows.tasks.classification import ClassificationConfig as config_class

    config = config_class(
        run=entry.run, results_dir=results_dir, progress=progress, baseline_result=baseline_result,
        non_private_result=non_private_result if MECHANISMS[entry.mechanism].is_private else None,
        **settings["config"],
    )
    if entry.mechanism == "public-only":
        return config, None
    if entry.mechanism == "non-private":
        return config, config.training_arguments("non-private", **settings["non_private"])
    fields = dict(settings["dp"], target_epsilon=entry.target_epsilon)
    if entry.adaptive:
        _check_adaptive_fields(settings.get("adaptive", {}))
        fields.update(settings["adaptive"])
    if MECHANISMS[entry.mechanism].sampled_unit == "examples":
        fields["expected_batch_size"] = examples_per_step
    if entry.mechanism == "example":
        fields.pop("contribution_bound")  # example-level DP-SGD keeps every row: no per-user bound
    return config, config.training_arguments(entry.mechanism, **fields)


def _check_adaptive_fields(adaptive: dict) -> None:
    from hf_dp.arguments import DPTrainingArguments

    known = {f.name for f in dataclasses.fields(DPTrainingArguments)}
    missing = sorted(set(adaptive) - known) if adaptive else ["adaptive_clipping"]
    if missing:
        raise ValueError(f"adaptive clipping runs need DPTrainingArguments fields {missing}, which this hf_dp does "
                         "not have; run the fixed-norm runs only (--runs) or update hf_dp.")
