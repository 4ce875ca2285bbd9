"""What the study behind `hf-dp demo` runs: its list of runs, and the run config and training arguments of each.

[`runs_of_study`] names the runs of a study (the demo's few, or the `--grid`: the task's own lists, see
[`~hf_dp.workflows.tasks.StudyTask`]), each a [`StudyRun`] (a mechanism, a target ε, a fixed or an adaptive
clipping norm); [`configure_run`] turns one into the task's run config and its
training arguments, from the settings of [`hf_dp.workflows.study_settings`]. [`hf_dp.workflows.study`] runs them.
"""

from __future__ import annotations

import dataclasses

from hf_dp.vocabulary import MECHANISMS
from hf_dp.workflows.tasks import get_task

__all__ = ["StudyRun", "adaptive_runs", "configure_run", "fixed_and_adaptive_runs", "matching_examples_per_step",
           "runs_of_study", "replicate_of", "run_config_class", "seed_suffix"]


@dataclasses.dataclass(frozen=True)
class StudyRun:
    """One entry of the study: a run name, its mechanism (a key of [`~hf_dp.vocabulary.MECHANISMS`]), target ε
    (`None`: non-private / public-only baseline) and whether the clipping norm is adaptive (the settings'
    `"adaptive"` fields on top of `"dp"`) or fixed."""

    run: str
    mechanism: str
    target_epsilon: float | None = None
    adaptive: bool = False
    seed: int = 0


def seed_suffix(seed: int) -> str:
    """`""` for seed 0 (the plain run names), `"-seed<k>"` otherwise."""
    return "" if seed == 0 else f"-seed{seed}"


def replicate_of(run: str) -> tuple[str, int]:
    """(`run` without its seed suffix, its seed): `("uls-eps8", 2)` for `"uls-eps8-seed2"`."""
    name, _, seed = run.rpartition("-seed")
    return (name, int(seed)) if name and seed.isdigit() else (run, 0)


def runs_of_study(grid: bool, task: str = "sft", seeds: int = 1) -> list[StudyRun]:
    """The demo's runs, or the grid's (baseline and non-private first: their numbers go into the DP cards), then
    the task's `headline_runs` ([`~hf_dp.workflows.tasks.StudyTask`]) again with seeds 1 to `seeds - 1` (named
    `<run>-seed<k>`; each seed its own test sample, training order, initialisation and noise). The runs are the
    task's `runs` (`grid_runs` with `grid`):

    Chat SFT (the default): ULS at ε ∈ {8, 3, 1} with an adaptive clipping norm, the privacy/utility curve (grid:
    ELS at the same ε and ULS at ε = 8 with the fixed norm too). Classification: ULS at ε = 8 with an adaptive
    clipping norm (grid: ULS and ELS at ε ∈ {8, 3, 1}, all adaptive, ULS at ε = 8 with the fixed norm beside it,
    and example-level at ε = 8). Causal LM: ULS at ε = 8 with a fixed and with an adaptive clipping norm (grid: ULS
    and ELS at ε ∈ {8, 3, 1}, each with a fixed and with an adaptive norm).
    """
    study_task = get_task(task)
    runs = [StudyRun("baseline", "public-only"), StudyRun("non-private", "non-private"),
            *(study_task.grid_runs if grid else study_task.runs)]
    if seeds < 1:
        raise ValueError(f"seeds={seeds}: use 1 or more.")
    headline = [r for r in runs if r.run in study_task.headline_runs]
    for seed in range(1, seeds):
        runs += [dataclasses.replace(r, run=r.run + seed_suffix(seed), seed=seed) for r in headline]
    return runs


def fixed_and_adaptive_runs(mechanisms, epsilons) -> tuple[StudyRun, ...]:
    """Each (mechanism, ε) with a fixed and with an adaptive clipping norm (`uls-eps8`, `uls-eps8-adaptive`)."""
    return tuple(StudyRun(f"{key}-eps{eps:g}" + ("-adaptive" if adaptive else ""), key, float(eps), adaptive)
                 for key in mechanisms for eps in epsilons for adaptive in (False, True))


def adaptive_runs(mechanism: str, epsilons) -> tuple[StudyRun, ...]:
    """`mechanism` at each ε with an adaptive clipping norm (`uls-eps8-adaptive`)."""
    return tuple(StudyRun(f"{mechanism}-eps{eps:g}-adaptive", mechanism, float(eps), True) for eps in epsilons)


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
                  task: str = "sft"):
    """The run config and training arguments of one study run (`None` for the public-only baseline, which trains
    nothing). ELS and example-level DP-SGD sample `examples_per_step` examples per step
    ([`matching_examples_per_step`]), ULS `settings["dp"]["expected_batch_size"]` users; an adaptive entry adds
    `settings["adaptive"]` (`adaptive_clipping=True`, ...) to the DP fields.

    Raises:
        ValueError: an adaptive entry while [`~hf_dp.DPTrainingArguments`] has no `adaptive_clipping` field.
    """
    config = run_config_class(task)(
        run=entry.run, results_dir=results_dir, progress=progress, baseline_result=baseline_result,
        non_private_result=non_private_result if MECHANISMS[entry.mechanism].is_private else None,
        **{**settings["config"], "seed": entry.seed},
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


def run_config_class(task: str) -> type:
    """The run config class of a task ([`~hf_dp.workflows.tasks.get_task`]): `ChatSFTConfig`,
    `LanguageModelingConfig` or `ClassificationConfig`."""
    return get_task(task).config()


def _check_adaptive_fields(adaptive: dict) -> None:
    from hf_dp.arguments import DPTrainingArguments

    known = {f.name for f in dataclasses.fields(DPTrainingArguments)}
    missing = sorted(set(adaptive) - known) if adaptive else ["adaptive_clipping"]
    if missing:
        raise ValueError(f"adaptive clipping runs need DPTrainingArguments fields {missing}, which this hf_dp does "
                         "not have; run the fixed-norm runs only (--runs) or update hf_dp.")
