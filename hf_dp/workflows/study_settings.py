"""The settings of the study behind `hf-dp demo` ([`hf_dp.workflows.study`]), and why each value was chosen.

Every number a study run trains with lives here, beside the reasons for it, so that the study's code
([`hf_dp.workflows.study`], [`hf_dp.workflows.study_runs`]) holds no tuned constant. Each settings dict has four
parts: `"config"` (fields of the task's run config), `"dp"` (the training arguments of the DP runs, under their
[`~hf_dp.DPTrainingArguments`] names), `"adaptive"` (added to `"dp"` for the adaptive-clipping runs) and
`"non_private"` (the `TrainingArguments` of the non-private run); every other field keeps its default there.

**The chat study** ([`SFT_SETTINGS`], the default of `hf-dp demo`; [`SFT_QUICK_SETTINGS`] for `--quick`):
SmolLM2-135M-Instruct fine-tuned with `DPSFTTrainer` (TRL's `SFTTrainer` for the non-private run) on the Shakespeare
conversations ([`hf_dp.workflows.chat_data.load_shakespeare_chat`]: a speech and the reply of another role, the
user the replying role), the six [`TUNING_PLAYS`] left out of training (817 of 1,098 roles remain, 19,416
conversations, δ = 1/(10·817) = 1.2e-4), the loss on the reply only. Its optimisation settings started as the
causal-LM study's (same model, same roles' lines; chosen there on the tuning plays only, see below) and were
checked on this task's own proxy, `benchmarks/chat_sft_tuning.py` (train on the conversations of three tuning
plays, evaluate on the other three, with the study's noise): at the same compute, 32 or 48 users per step for 30 or
20 steps and a doubled learning rate were level or worse (docs/studies.md has the table). So: LoRA r = 8 on the
attention queries and values of the top 4 of the 30 layers, ULS with 16 roles per step (q = 0.0196 over the 817
training roles) and G = 1 conversation each, 60 steps, Adam at 1e-2 with linear decay, C₀ = 0.1 with
adaptive clipping towards the median (σ_b = 1.6); non-private: 60 steps of 16 conversations at 1e-2. Three choices
are for time on a 2-core machine, all public: conversations are cut to 64 tokens (SFTTrainer's `max_length`; a
longer one loses the start of its prompt and keeps its reply; 16 rows of 64 tokens make a step), a short system
prompt ([`SFT_SYSTEM_PROMPT`]) replaces SmolLM2's default one, which would take 20 of the 64 tokens, and training
runs in bf16 autocast where the CPU multiplies bf16 natively (`bf16_on_cpu`: a step 2.2 s instead of 3.9).
Activation checkpointing (SFTConfig's default) is off: with adapters in the top 4 layers only, it would make the
whole network take part in the backward pass. [`SFT_FULL_SETTINGS`] (`--full`) trains 48 roles per step for 120
steps.

**Classification** ([`DEMO_SETTINGS`], and [`QUICK_SETTINGS`] for `--quick`). The fine-tuned classifier *starts as
the public-only baseline*: mean-pooled MiniLM embeddings, a head whose rows are the label descriptions' embeddings,
logits = 20 x cosine similarity ([`~hf_dp.workflows.tasks.classifier_models.EmbeddingClassifier`]); fine-tuning
trains rank-8 LoRA adapters on the attention queries and values and that head (≈ 75 k of 22.7 M weights). Li et al.
(2021) advise this alignment of the fine-tuning objective with pretraining; with a new, random classification head
(`head="linear"`) DP training at ε = 8 fell well *below* the baseline in the first round's measurements (0.36
against 0.43). Texts are cut to 32 tokens (the median speech is 19). The six [`TUNING_PLAYS`] are left out of
training, as in the causal-LM study (820 of 1,101 roles remain, δ = 1/(10·820) = 1.2e-4).

ULS: 32 roles per step (q = 0.039), at most G = 8 speeches each (≈ 175 speeches per step), 200 steps, Adam at
learning rate 2e-3 with linear decay; the adaptive runs start at C = 1 and follow the median per-role norm (count
noise σ_b = m/20: 1.6 for ULS), the fixed run keeps C = 1 (nearly every per-role gradient is clipped). ELS and
example-level DP-SGD sample the same expected number of speeches per step, so every DP run costs about the same.
Non-private: 400 steps of 32 speeches at learning rate 2e-3.

Why G = 8: bounding each role's influence changes what is learnt. Non-private fine-tuning on the 2,005 speeches that
the first round's G = 2 kept reached only the baseline (0.434-0.440), against 0.455-0.461 for G = 8 and 0.466-0.473
for every speech (`benchmarks/user_weighting.py --finetune`, run on the training roles before this round: a use of
private data the guarantee does not cover, reported as such). Why 32 roles per step: G = 8 quadruples the speeches
per role, so 32 roles keep a step at the first round's cost. The learning rate was chosen on the tuning plays
(`benchmarks/classification_tuning.py`: train on the roles of three of them, measure the accuracy on every speech
of the other three, with the study's noise), never on a training role or a test play: ULS at ε = 8 with adaptive
clipping reached 0.429 at 2e-3 and 0.401 at 1e-2, against 0.459 for the zero-shot baseline on those speeches (C
settled at 12-20). That proxy trains on one play per genre, so it rewards fine-tuning little; it ranked the rates,
not whether fine-tuning pays. Adaptive clipping stays on: on the same proxy, clipping at the median per-role norm
keeps 0.87 of the per-step signal-to-noise ratio of clipping every role (`benchmarks/clipping_snr.py`; the fixed
C = 1 run differed from the adaptive one by 1.2 standard errors, within the noise). `--quick` runs the same
pipeline on a tiny subset in well under a minute (for tests; its numbers mean nothing).

**The causal-LM study** ([`CAUSAL_LM_SETTINGS`], and [`CAUSAL_LM_QUICK_SETTINGS`] for `--quick`), chosen without
touching a training role or a test play: six of the 29 training plays ([`TUNING_PLAYS`], two per genre) are left out
of the study's training data (820 of 1,101 roles remain, δ = 1/(10·820) = 1.2e-4) and
`benchmarks/causal_lm_tuning.py` trained on the roles of three of them and measured the NLL on speeches of the other
three, with the noise a study run adds (σ calibrated for the study's q, steps, ε = 8 and δ), 60 steps each, one run
per setting. LoRA r = 8 on the attention queries and values of the top 4 of the 30 layers (61 k weights), 40-token
speeches, Adam with linear decay. On that proxy (untouched NLL 5.725) the learning rate was the lever: ULS at ε = 8
gained 0.031 nats at 1e-3, 0.515 at 1e-2, 0.454 at 3e-2, and non-private fine-tuning 0.445 at 1e-3, 0.629 at 3e-3,
0.741 at 1e-2, 0.686 at 3e-2; so both use 1e-2. The top 2 layers gained 0.460, the top 8 0.512, the top 4 0.515; a
rank-1 adapter on the values only (3 k weights) 0.525 at its best rate (3e-2). Clipping norm C = 0.1: below the 5 %
quantile of the per-speech gradient norms at initialisation (0.13, median 0.21), so every unit is clipped; with the
adaptive norm (C_0 = 0.1, target the median) C ended at 1.3 and the gain was the same, 0.519. `--quick` runs the
same pipeline on a tiny subset of the roles with SmolLM2 itself (a few minutes; meaningless numbers).
"""

from __future__ import annotations

from hf_dp.workflows.tasks import get_task, registered_tasks

__all__ = ["CAUSAL_LM_QUICK_SETTINGS", "CAUSAL_LM_SETTINGS", "DEFAULT_TASK", "DEMO_SETTINGS", "QUICK_SETTINGS",
           "SFT_FULL_SETTINGS", "SFT_QUICK_SETTINGS", "SFT_SETTINGS", "SFT_SYSTEM_PROMPT", "TUNING_EVAL_PLAYS",
           "TUNING_PLAYS", "TUNING_TRAIN_PLAYS", "check_task", "study_settings", "task_names"]

# The causal-LM study's tuning proxy: six training plays (two per Folio genre, drawn by
# `corpora.split_plays(<the 29 training plays>, 0.2, seed=1)`) whose roles the study never trains on. Its
# hyper-parameters were chosen by training on the roles of the first three (TUNING_TRAIN_PLAYS) and evaluating on
# the speeches of the other three (TUNING_EVAL_PLAYS, one per genre each: `split_plays(TUNING_PLAYS, 0.5, seed=1)`),
# with `benchmarks/causal_lm_tuning.py`: no training role and no test play took part in the choice.
TUNING_TRAIN_PLAYS = ("Coriolanus", "Henry VI, Part 1", "The Tempest")
TUNING_EVAL_PLAYS = ("As You Like It", "Henry V", "Timon of Athens")
TUNING_PLAYS = tuple(sorted(TUNING_TRAIN_PLAYS + TUNING_EVAL_PLAYS))

# Shared by every run of the study (why: see the module docstring). "config": ClassificationConfig fields;
# "dp", "adaptive" and "non_private": the training arguments (DPTrainingArguments / TrainingArguments field names)
# of the DP runs, of the adaptive-clipping runs on top of "dp", and of the non-private run; every other field keeps
# its default there. The TUNING_PLAYS are left out of training: the settings were chosen on them.
DEMO_SETTINGS = dict(
    config=dict(
        max_length=32,
        head="similarity",
        use_lora=True,
        lora_r=8,
        lora_alpha=16,
        lora_target_modules=["query", "value"],
        exclude_train_plays=list(TUNING_PLAYS),
        eval_batch_size=128,
    ),
    # DP runs: ULS samples 32 of the 820 training roles per step (q = 0.039) and keeps at most G = 8 speeches of
    # each (≈ 175 speeches per step); ELS and example-level DP-SGD sample the same expected number of speeches per
    # step (computed from the data: users per step x mean min(speeches, G)), so every DP run costs about the same.
    # Example-level DP-SGD keeps every row (its contribution_bound is unused). max_grad_norm is the fixed C, and
    # the initial C of the adaptive runs.
    dp=dict(
        expected_batch_size=32,
        contribution_bound=8,
        max_steps=200,
        learning_rate=2e-3,
        max_grad_norm=1.0,
        per_device_train_batch_size=64,
    ),
    # Adaptive clipping (Andrew et al. 2021): C tracks the median of the per-unit norms at the paper's rate, with the
    # trainer's default count noise σ_b = m/20 of each run's expected batch (1.6 for ULS's 32 roles, 8.75 for the
    # ≈ 175 speeches of ELS and example-level). A fixed σ_b = 1.6 fails ELS at ε = 3: its σ_eff (group accounting
    # over G = 8 speeches) is 5.5, and σ_b must exceed σ_eff/2 (the trainer refuses with that message).
    adaptive=dict(
        adaptive_clipping=True,
        target_unclipped_quantile=0.5,
        clipping_learning_rate=0.2,
        clipping_count_noise=None,
    ),
    # Non-private: ordinary mini-batches of 32 speeches, 400 steps (about two thirds of an epoch).
    non_private=dict(
        per_device_train_batch_size=32,
        learning_rate=2e-3,
        max_steps=400,
    ),
)

# --quick: the same code paths on a tiny subset (tests); the numbers mean nothing.
QUICK_SETTINGS = dict(
    config=dict(DEMO_SETTINGS["config"], max_length=16, max_train_users=48, max_eval_examples=48),
    dp=dict(DEMO_SETTINGS["dp"], expected_batch_size=8, max_steps=2, per_device_train_batch_size=16),
    adaptive=DEMO_SETTINGS["adaptive"],
    non_private=dict(DEMO_SETTINGS["non_private"], per_device_train_batch_size=8, max_steps=2),
)


# The causal-LM study (`--task causal_lm`; why these values: the module docstring). "config":
# LanguageModelingConfig fields (`model_name_or_path` None: SmolLM2-135M-Instruct, [`smollm2_path`]); "dp",
# "adaptive", "non_private": training-argument fields of the DP runs, of the adaptive-clipping runs on top of
# "dp", and of the non-private run.
CAUSAL_LM_SETTINGS = dict(
    config=dict(
        model_name_or_path=None,
        max_length=40,
        use_lora=True,
        lora_r=8,
        lora_alpha=16,
        lora_target_modules=["q_proj", "v_proj"],
        lora_layers=[26, 27, 28, 29],
        exclude_train_plays=list(TUNING_PLAYS),
        max_eval_examples=400,
        eval_batch_size=64,
    ),
    # ULS samples 16 of the 820 training roles per step (q = 0.0195) and one speech of each (G = 1): 16 speeches
    # per step, and ELS the same expected 16 speeches; 60 steps. max_loss only clips the logged loss (NLL ≈ 5.5).
    dp=dict(
        expected_batch_size=16,
        contribution_bound=1,
        max_steps=60,
        learning_rate=1e-2,
        max_grad_norm=0.1,
        per_device_train_batch_size=32,
        max_loss=10.0,
    ),
    # Adaptive clipping (Andrew et al. 2021): max_grad_norm above is the initial C, then C tracks the median of the
    # per-unit norms at the paper's rate. The count noise is σ_b = expected_batch_size / 10 = 1.6, not the paper's
    # m/20: at 16 units per step m/20 would add 4 %, 9 % and 23 % gradient noise at ε = 8, 3, 1, m/10 adds 0.6 %,
    # 1.6 % and 4 %, and the noise on the estimated fraction (std 0.1) stays below its sampling noise (≈ 0.125).
    adaptive=dict(
        adaptive_clipping=True,
        target_unclipped_quantile=0.5,
        clipping_learning_rate=0.2,
        clipping_count_noise=1.6,
    ),
    # Non-private: 60 steps of 16 speeches, the DP runs' compute.
    non_private=dict(
        per_device_train_batch_size=16,
        learning_rate=1e-2,
        max_steps=60,
    ),
)

# --task causal_lm --quick: the same code paths on a tiny subset (SmolLM2 itself; the numbers mean nothing).
CAUSAL_LM_QUICK_SETTINGS = dict(
    config=dict(CAUSAL_LM_SETTINGS["config"], max_length=16, max_train_users=48, max_eval_examples=16),
    dp=dict(CAUSAL_LM_SETTINGS["dp"], expected_batch_size=4, max_steps=2, per_device_train_batch_size=8),
    adaptive=dict(CAUSAL_LM_SETTINGS["adaptive"], clipping_count_noise=None),  # m/20 for m = 4
    non_private=dict(CAUSAL_LM_SETTINGS["non_private"], per_device_train_batch_size=4, max_steps=2),
)

# The chat study (`--task sft`, the default; why these values: the module docstring). "config": ChatSFTConfig
# fields; "dp", "adaptive", "non_private": DPSFTConfig / SFTConfig fields.
SFT_SYSTEM_PROMPT = "You are a character in a play by Shakespeare."
SFT_SETTINGS = dict(
    config=dict(
        model_name_or_path=None,
        max_length=64,
        system_prompt=SFT_SYSTEM_PROMPT,
        use_lora=True,
        lora_r=8,
        lora_alpha=16,
        lora_target_modules=["q_proj", "v_proj"],
        lora_layers=[26, 27, 28, 29],
        exclude_train_plays=list(TUNING_PLAYS),
        max_eval_examples=256,
        eval_batch_size=32,
        bf16_on_cpu=True,
    ),
    # ULS samples 16 of the training roles per step and one conversation of each (G = 1); ELS the same expected 16
    # conversations; 60 steps. Activation checkpointing (SFTConfig's default) off: it would make the whole
    # network take part in the backward pass, while the adapters sit in the top 4 layers.
    dp=dict(
        expected_batch_size=16,
        contribution_bound=1,
        max_steps=60,
        learning_rate=1e-2,
        max_grad_norm=0.1,
        per_device_train_batch_size=16,
        max_loss=10.0,
        gradient_checkpointing=False,
    ),
    adaptive=CAUSAL_LM_SETTINGS["adaptive"],
    non_private=dict(
        per_device_train_batch_size=16,
        learning_rate=1e-2,
        max_steps=60,
        gradient_checkpointing=False,
    ),
)

# --full (chat SFT only): more users per step and more steps, the opt-in study that needs about an hour on 2 cores:
# 48 users per step (q ≈ 0.063) for 120 steps, six times the default's conversations; non-private at that compute.
SFT_FULL_SETTINGS = dict(
    config=SFT_SETTINGS["config"],
    dp=dict(SFT_SETTINGS["dp"], expected_batch_size=48, max_steps=120, per_device_train_batch_size=48),
    adaptive=dict(SFT_SETTINGS["adaptive"], clipping_count_noise=4.8),  # m/10, as the default's 1.6 for 16
    non_private=dict(SFT_SETTINGS["non_private"], per_device_train_batch_size=48, max_steps=120),
)

# --task sft --quick: the same code paths on a tiny subset (SmolLM2 itself; the numbers mean nothing).
SFT_QUICK_SETTINGS = dict(
    config=dict(SFT_SETTINGS["config"], max_length=48, max_train_users=48, max_eval_examples=8),
    dp=dict(SFT_SETTINGS["dp"], expected_batch_size=4, max_steps=2, per_device_train_batch_size=8),
    adaptive=dict(SFT_SETTINGS["adaptive"], clipping_count_noise=None),  # m/20 for m = 4
    non_private=dict(SFT_SETTINGS["non_private"], per_device_train_batch_size=4, max_steps=2),
)

DEFAULT_TASK = "sft"


def study_settings(task: str = DEFAULT_TASK, quick: bool = False, full: bool = False) -> dict:
    """The settings of a study, from its task's `settings` ([`~hf_dp.workflows.tasks.StudyTask`]):
    [`SFT_SETTINGS`] / [`SFT_QUICK_SETTINGS`] / [`SFT_FULL_SETTINGS`] (chat SFT, the default),
    [`CAUSAL_LM_SETTINGS`] / [`CAUSAL_LM_QUICK_SETTINGS`] or [`DEMO_SETTINGS`] / [`QUICK_SETTINGS`]
    (classification).

    Raises:
        ValueError: an unknown task, or `full` for a task with no full settings, or with `quick`.
    """
    settings = get_task(task).settings
    if full:
        if quick:
            raise ValueError("--full and --quick: choose one (--quick is the tiny test subset).")
        if "full" not in settings:
            with_full = [key for key, other in registered_tasks().items() if "full" in other.settings]
            raise ValueError(f"--full: only {', '.join(with_full)} has a full study; --task {task} has its "
                             "default settings and --grid.")
        return settings["full"]
    return settings["quick" if quick else "default"]


def task_names() -> tuple[str, ...]:
    """The registered tasks' names ([`~hf_dp.workflows.tasks.registered_tasks`]): `--task`'s choices."""
    return tuple(registered_tasks())


def check_task(task: str) -> str:
    """`task` if it is a registered task; else `ValueError`."""
    return get_task(task).key
