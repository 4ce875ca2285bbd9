"""The Train tab: a short run in a background thread, its progress through a TrainerCallback and a queue.

Two tasks ([`TRAIN_TASKS`]): **chat SFT** (the default), SmolLM2-135M-Instruct fine-tuned with LoRA to reply as
Shakespeare's roles ([`hf_dp.workflows.tasks.chat_sft.run_chat_sft`], [`~hf_dp.sft.DPSFTTrainer`]), and
**classification**, the embedded MiniLM on the Shakespeare genres
([`hf_dp.workflows.tasks.classification.run_classification`]), each on a seeded subset of the training roles. The
mechanism, `target_epsilon` and `expected_batch_size` the page sets are the trainer's arguments, and the ε shown is
the trainer's ledger value (its `dp/epsilon` log); the guarantee covers the rows trained on. A
[`~transformers.TrainerCallback`] puts each step and log on a queue, the page's timer drains it ([`TrainingJob.poll`]).

Every setting is checked before a model loads: the form's values and the trainer's arguments when the button is
pressed ([`check_settings`]), then the privacy plan on the rows the trainer will see, the subset loaded and, for
chat, tokenized as `SFTTrainer` prepares it ([`check_plan`], `hf_dp.privacy_plan.plan_privacy`, what the trainer
runs), a few seconds in. Errors name the form's fields by their labels ([`form_error`]). A run that fails leaves
nothing behind (its model folder is removed). A chat run keeps its LoRA adapter (`adapter_model.safetensors`,
about 0.25 MB, with its tokenizer, privacy card and ledger), not a 538 MB merged model: it loads onto the
SmolLM2 base; a classification run keeps its merged MiniLM (about 90 MB).
"""

from __future__ import annotations

import copy
import dataclasses
import queue
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

from hf_dp.formatting import format_epsilon, format_number, format_significant
from hf_dp.command_line import check_numbers
from hf_dp.vocabulary import DP_MECHANISMS, MECHANISMS, lower_is_better

from .common import AppError, error_md, one_line
from .results import APP_RUNS_DIR

# What the Train tab offers: the DP mechanisms and the non-private comparison.
TRAIN_MECHANISMS = DP_MECHANISMS + ("non-private",)
# Its tasks: the label of the choice, and the subset, steps and batch its controls default to (about a minute or
# two on 2 CPU cores). The chat run is the chat study's recipe (`SFT_SETTINGS` of hf_dp.workflows.study_settings).
DEFAULT_TRAIN_TASK = "chat-sft"  # the Train tab's first choice
TRAIN_TASKS = {
    "chat-sft": dict(label="Chat SFT: SmolLM2-135M-Instruct replies as a Shakespeare role (LoRA)",
                     max_train_users=64, max_steps=6, expected_batch_size=8, max_eval_examples=32),
    "classification": dict(label="Classification: MiniLM predicts a speech's genre (LoRA)",
                           max_train_users=96, max_steps=8, expected_batch_size=24, max_eval_examples=128),
}


# The Train tab's boxes, by the TrainingSettings field each sets: the labels errors name them by.
TRAIN_LABELS = {"task": "task", "mechanism": "mechanism", "target_epsilon": "target_epsilon (ε)",
                "max_train_users": "training users (subset)", "max_steps": "max_steps",
                "max_eval_examples": "test examples"}


def batch_size_label(mechanism: str) -> str:
    """The label of the Train tab's `expected_batch_size` box, with the unit `mechanism` samples."""
    unit = MECHANISMS[mechanism].sampled_unit if mechanism in MECHANISMS else None
    if unit is None:
        return "expected_batch_size (not used without DP: plain batches)"
    return f"expected_batch_size ({unit} per step)"


def form_error(message, mechanism: str | None = None) -> str:
    """`message` (or an exception's) on one line, in the words of the Train tab's form: a field on the form, as a
    flag (`--expected_batch_size`) or a keyword (`max_steps=0`), becomes its label in quotes (“expected_batch_size
    (users per step)”, “max_steps” = 0); a flag of a setting the form does not show (`--noise_multiplier`) becomes
    its name, said to be the study's recipe's."""
    labels = dict(TRAIN_LABELS, expected_batch_size=batch_size_label(mechanism or "uls"))

    def flag(match):
        name = match.group(1)
        return f"“{labels[name]}”" if name in labels else f"{name} (a setting of the study's recipe, not on this form)"

    def keyword(match):
        name = match.group(1)
        return f"“{labels[name]}” = " if name in labels else match.group(0)

    text = one_line(message) if isinstance(message, BaseException) else " ".join(str(message).split())
    text = re.sub(r"--([a-z_]+)\b", flag, text)
    return re.sub(r"\b([a-z_]+)=(?=\S)", keyword, text)


def queue_callback_class():
    """A [`~transformers.TrainerCallback`] class that puts (event, fields) on a queue (imported lazily)."""
    from transformers import TrainerCallback

    class QueueCallback(TrainerCallback):
        """Puts (event, fields) on a queue at each step and log: step, max_steps, ε spent, loss."""

        def __init__(self, events: queue.Queue):
            self.events = events

        def phase(self, status: str) -> None:
            """What the run does before its first step ("checking", "loading"), for the progress line."""
            self.events.put(("phase", {"status": status}))

        def on_train_begin(self, args, state, control, **kwargs):
            self.events.put(("begin", {"step": state.global_step, "max_steps": state.max_steps}))

        def on_step_end(self, args, state, control, **kwargs):
            self.events.put(("step", {"step": state.global_step, "max_steps": state.max_steps}))

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = dict(logs or {})
            fields = {"step": state.global_step, "max_steps": state.max_steps}
            if "dp/epsilon" in logs:
                fields["epsilon"] = float(logs["dp/epsilon"])
            if "loss" in logs:
                fields["loss"] = float(logs["loss"])
            self.events.put(("log", fields))

    return QueueCallback


@dataclasses.dataclass
class TrainingSettings:
    """What the Train tab asks for; the rest of the run follows the study's settings on a small subset.

    `task` is a key of [`TRAIN_TASKS`]; `mechanism` a key of [`~hf_dp.vocabulary.MECHANISMS`] (a DP one, or
    `"non-private"`); `target_epsilon` and `expected_batch_size` are the [`~hf_dp.DPTrainingArguments`] fields
    (users per step for ULS, examples per step for ELS and example-level), checked for the DP mechanisms only (a
    non-private run does not use them). Counts are whole numbers >= 1 (an integral float from a form, 8.0, becomes
    the int) and ε a finite number > 0: anything else (0, a negative or fractional count, NaN, an empty box) raises
    [`AppError`] naming the field, before a run starts. `max_eval_examples` `None`: the task's default.
    """

    mechanism: str = "uls"
    target_epsilon: float = 8.0
    max_train_users: int = TRAIN_TASKS["chat-sft"]["max_train_users"]
    max_steps: int = TRAIN_TASKS["chat-sft"]["max_steps"]
    expected_batch_size: int = TRAIN_TASKS["chat-sft"]["expected_batch_size"]
    max_eval_examples: int | None = None
    task: str = "chat-sft"

    def __post_init__(self):
        if self.task not in TRAIN_TASKS:
            raise AppError(f"task={self.task!r}: use one of {tuple(TRAIN_TASKS)}.")
        if self.mechanism not in TRAIN_MECHANISMS:
            raise AppError(f"mechanism={self.mechanism!r}: use one of {TRAIN_MECHANISMS}.")
        rules = {"max_train_users": "int>=2", "max_steps": "int>=1", "max_eval_examples": "int>=1"}
        if self.mechanism in DP_MECHANISMS:
            rules.update(target_epsilon="float>0", expected_batch_size="int>=1")
        try:
            check_numbers(self, rules, flags=False)
        except ValueError as error:
            raise AppError(str(error)) from None
        if self.max_eval_examples is None:
            self.max_eval_examples = TRAIN_TASKS[self.task]["max_eval_examples"]


class TrainingJob:
    """One background training run with its progress (only one at a time per app).

    Args:
        run_fn (`Callable`): `run_fn(settings, results_dir, callbacks) -> result dict`; defaults to
            [`run_app_training`]. Tests pass a fake.
    """

    def __init__(self, run_fn: Callable | None = None):
        self.run_fn = run_fn or run_app_training
        self.events: queue.Queue = queue.Queue()
        self.thread: threading.Thread | None = None
        self.state: dict = {"status": "idle"}
        self.lock = threading.Lock()

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def start(self, settings: TrainingSettings, results_dir) -> None:
        with self.lock:
            if self.running:
                raise AppError(self.busy_message())
            self.events = queue.Queue()
            private = settings.mechanism in DP_MECHANISMS
            self.state = {"status": "starting", "step": 0, "max_steps": settings.max_steps, "epsilon": 0.0,
                          "target_epsilon": settings.target_epsilon if private else None,
                          "mechanism": settings.mechanism, "started": time.time()}
            callback = queue_callback_class()(self.events)
            self.thread = threading.Thread(target=self._work, args=(settings, results_dir, callback),
                                           name="hf-dp-app-training", daemon=True)
            self.thread.start()

    def busy_message(self) -> str:
        """What a second Start is told while a run trains (its progress stays on the page)."""
        state = self.state
        return (f"A run is already training (step {state.get('step', 0)}/{state.get('max_steps', '?')}): this Start "
                "was not taken. Wait for it to finish (its progress is above), then start another.")

    def dismiss_failure(self) -> None:
        """Clear a failed run's bar and message (a new form error replaces them); a running or finished run stays."""
        with self.lock:
            if self.state.get("status") == "error" and not self.running:
                self.state = {"status": "idle"}

    def _work(self, settings, results_dir, callback) -> None:
        try:
            result = self.run_fn(settings, results_dir, [callback])
            self.events.put(("done", {"result": result}))
        except BaseException as error:  # shown in the page as one line, in the form's words
            self.events.put(("error", {"error": form_error(error, settings.mechanism)}))

    def poll(self) -> dict:
        """Drain the queue into the state and return a copy (several open pages may poll at once)."""
        with self.lock:
            state = self.state
            while True:
                try:
                    event, fields = self.events.get_nowait()
                except queue.Empty:
                    break
                if event == "phase" and state.get("status") in ("starting", "checking", "loading"):
                    state["status"] = fields["status"]
                elif event in ("begin", "step", "log"):
                    state["status"] = "training"
                    for key in ("step", "max_steps", "epsilon", "loss"):
                        if fields.get(key) is not None and (key != "max_steps" or fields[key] > 0):
                            state[key] = fields[key]
                elif event == "done":
                    state.update(status="done", result=fields["result"], finished=time.time())
                elif event == "error":
                    state.update(status="error", error=fields["error"], finished=time.time())
            return dict(state)


@dataclasses.dataclass
class PreparedRun:
    """A Train-tab run built from its settings, before any data or model loads: the task's run config and the
    trainer's arguments."""

    settings: TrainingSettings
    config: object
    arguments: object

    @property
    def model_dir(self) -> Path:
        return Path(self.arguments.output_dir)


def _run_name(settings: TrainingSettings, runs_dir: Path) -> str:
    """A new run name (the mechanism, ε and the time), with a suffix if a run of that name is already there."""
    stamp = time.strftime("%H%M%S")
    prefix = "app-chat" if settings.task == "chat-sft" else "app"
    private = settings.mechanism in DP_MECHANISMS
    name = (f"{prefix}-{settings.mechanism}-eps{settings.target_epsilon:g}-{stamp}" if private
            else f"{prefix}-{settings.mechanism}-{stamp}")
    candidate, n = name, 1
    while (runs_dir / f"{candidate}.json").exists() or (runs_dir / "models" / candidate).exists():
        n += 1
        candidate = f"{name}-{n}"
    return candidate


def prepare_run(settings: TrainingSettings, results_dir) -> PreparedRun:
    """The run config and the trainer's arguments of `settings` (the arguments' own checks run here: a bad value
    raises their one-line `ValueError`). Loads no data and no model.

    The mechanism, `target_epsilon` and `expected_batch_size` are `settings`'; the rest is the task's recipe: the
    chat study's `SFT_SETTINGS` (LoRA on the top 4 layers, 64 tokens, its system prompt and optimiser, G = 1; the
    adapter alone is saved), or the classification study's recipe at 32 tokens with G = 2.
    """
    mechanism = settings.mechanism
    private = mechanism in DP_MECHANISMS
    runs_dir = Path(results_dir) / APP_RUNS_DIR
    common = dict(run=_run_name(settings, runs_dir), results_dir=str(runs_dir), use_lora=True, progress=False,
                  max_train_users=int(settings.max_train_users), max_eval_examples=int(settings.max_eval_examples))
    # DPTrainingArguments / TrainingArguments fields; logging every step gives the progress bar ε and loss
    fields = dict(max_steps=int(settings.max_steps), logging_steps=1)
    if private:
        fields.update(target_epsilon=float(settings.target_epsilon),
                      expected_batch_size=int(settings.expected_batch_size))
    if settings.task == "chat-sft":
        from hf_dp.workflows.pretrained import smollm2_path
        from hf_dp.workflows.study_settings import SFT_SETTINGS
        from hf_dp.workflows.tasks.chat_sft import ChatSFTConfig

        config = ChatSFTConfig(**{**SFT_SETTINGS["config"], **common, "model_name_or_path": str(smollm2_path()),
                                  "save_adapter_only": True})
        recipe = SFT_SETTINGS["dp" if private else "non_private"]
        return PreparedRun(settings, config, config.training_arguments(mechanism, **{**recipe, **fields}))
    from hf_dp.workflows.tasks.classification import ClassificationConfig

    config = ClassificationConfig(**common, max_length=32, lora_target_modules=["query", "value"])
    if private:
        fields.update(contribution_bound=2, per_device_train_batch_size=64)
    else:
        fields.update(per_device_train_batch_size=16)
    return PreparedRun(settings, config, config.training_arguments(mechanism, **fields))


def check_settings(settings: TrainingSettings, results_dir) -> PreparedRun:
    """[`prepare_run`], its errors in the form's words ([`form_error`]) as [`AppError`]: what the Start button
    checks before a run starts (about a second; no data, no model)."""
    try:
        return prepare_run(settings, results_dir)
    except Exception as error:
        raise AppError(form_error(error, settings.mechanism)) from None


# Gradient values noised per step, for the plan's check of the noise sampler's δ before the model is loaded: an
# upper bound (the planner's), so the check is never weaker than the trainer's.
_NOISED_UPPER_BOUND = 10**11


def load_data(prepared: PreparedRun):
    """The run's data (the subset of training roles and the test rows), loaded as the task's run loads it."""
    if prepared.settings.task == "chat-sft":
        from hf_dp.workflows.tasks.chat_sft import load_chat_data

        return load_chat_data(prepared.config)
    from hf_dp.workflows.tasks.classification import load_classification_data

    return load_classification_data(prepared.config)


def check_plan(prepared: PreparedRun, data):
    """The trainer's privacy plan for `data`, before any model loads; its refusal in the form's words.

    The rows are those the trainer will partition by user: for chat, the conversations tokenized as `SFTTrainer`
    prepares them (a conversation longer than the 64 tokens loses the start of its prompt and keeps its reply); for
    classification, the training rows. They are partitioned under G ([`hf_dp.contribution.partition`]) and planned with
    [`hf_dp.privacy_plan.plan_privacy`], the trainer's own checks (an `expected_batch_size` above the users or examples
    there are, a δ not below 1/users, an ε no noise reaches, the sampler's δ). Nothing here is released, so it spends no
    ε. A non-private run has no plan.

    Returns:
        The [`~hf_dp.privacy_plan.PrivacyPlan`], or `None` for a non-private run.

    Raises:
        AppError: what the trainer would refuse, naming the form's fields.
    """
    settings, arguments = prepared.settings, prepared.arguments
    if settings.mechanism not in DP_MECHANISMS:
        return None
    from hf_dp import contribution
    from hf_dp.privacy_plan import plan_privacy

    column = prepared.config.user_id_column
    if settings.task == "chat-sft":
        from hf_dp.workflows.tasks.chat_sft import prepare_chat_tokenizer, tokenize_prompt_completion

        tokenizer = prepare_chat_tokenizer(None, prepared.config)
        rows = tokenize_prompt_completion(data.train, tokenizer, max_length=arguments.max_length,
                                          truncation_mode=arguments.truncation_mode, keep_columns=(column,))
    else:
        rows = data.train
    arguments = copy.deepcopy(arguments)  # plan_privacy sets max_steps on the arguments it is given
    try:
        partition = contribution.partition(rows, arguments, contribution.data_secret(arguments))
        return plan_privacy(arguments, partition, noised_elements=_NOISED_UPPER_BOUND)
    except ValueError as error:
        raise AppError(form_error(error, settings.mechanism)) from None


def run_app_training(settings: TrainingSettings, results_dir, callbacks: Sequence, *,
                     prepared: PreparedRun | None = None) -> dict:
    """A short fine-tuning run of `settings.task` ([`TRAIN_TASKS`]) on a seeded subset of the training roles.

    First the settings ([`check_settings`], unless `prepared` is given) and the privacy plan on the loaded data
    ([`check_plan`]), then the model loads and trains. Writes `results_dir/app-runs/<run>.json` and the model (for
    chat, its LoRA adapter) + privacy card to `results_dir/app-runs/models/<run>/`; a run that fails removes that
    folder. The mechanism, `target_epsilon` and `expected_batch_size` are `settings`'; the guarantee is the
    trainer's for the rows trained on. A callback with a `phase(status)` attribute hears "checking" and "loading".
    """
    def phase(status: str) -> None:
        for callback in callbacks:
            if hasattr(callback, "phase"):
                callback.phase(status)

    phase("checking")
    prepared = prepared or check_settings(settings, results_dir)
    model_dir = prepared.model_dir
    existed = model_dir.exists()
    try:
        data = load_data(prepared)
        check_plan(prepared, data)
        phase("loading")
        if settings.task == "chat-sft":
            from hf_dp.workflows.tasks.chat_sft import run_chat_sft

            return run_chat_sft(prepared.config, prepared.arguments, data=data, callbacks=list(callbacks))
        from hf_dp.workflows.tasks.classification import run_classification

        return run_classification(prepared.config, prepared.arguments, data=data, callbacks=list(callbacks))
    except BaseException:
        if not existed:
            shutil.rmtree(model_dir, ignore_errors=True)  # never an empty or half-written model folder
        raise


def train_description(task: str, results_dir) -> str:
    """The Train tab's words on what `task` trains (markdown)."""
    where = f"Its model, privacy card and result go to `{results_dir}/{APP_RUNS_DIR}/`"
    if task == "chat-sft":
        return ("A short LoRA run of SmolLM2-135M-Instruct with `DPSFTTrainer` on the Shakespeare conversations: each "
                "user is a speaking role, each conversation a speech and that role's reply (the chat study's recipe, "
                f"64 tokens, on a seeded subset of the roles). {where}, so the Compare tab can then generate with it. "
                "The loss shown is the trainer's noised release, covered by ε. On 2 CPU cores expect a minute or two.")
    return ("A short run of the embedded MiniLM on a small subset of the Shakespeare genres (users are speaking "
            f"roles). It uses the study's recipe (LoRA, 32 tokens). {where}. On 2 CPU cores expect about a minute.")


def progress_html(state: Mapping) -> str:
    """The Train tab's progress bar and status line (HTML)."""
    status = state.get("status", "idle")
    if status == "idle":
        return "<div id='train-progress'>No run started.</div>"
    total = max(int(state.get("max_steps") or 0), 1)
    step = min(int(state.get("step") or 0), total)
    fraction = 1.0 if status == "done" else step / total
    eps = state.get("epsilon")
    target = state.get("target_epsilon")
    if state.get("mechanism") in MECHANISMS and not MECHANISMS[state["mechanism"]].is_private:
        eps_text = f"no privacy guarantee ({state['mechanism']})"
    else:
        spent = format_epsilon(eps) if eps is not None else "0"
        eps_text = f"ε spent {spent}" + (f" of {target:g}" if target and eps is not None else "")
    noised = "noised " if state.get("mechanism") in DP_MECHANISMS else ""
    loss = f", {noised}loss {state['loss']:.3f}" if state.get("loss") is not None else ""
    elapsed = state.get("finished", time.time()) - state.get("started", time.time())  # a finished run's clock stops
    words = {"starting": "Starting…", "checking": "Checking the settings on the data (no model loaded yet)…",
             "loading": "Loading the model and scoring the untouched model…", "training": "Training",
             "done": "Finished", "error": "Failed"}
    color = {"error": "#c0392b", "done": "#2e7d32"}.get(status, "#1f6feb")
    return (
        "<div id='train-progress'>"
        f"<div style='background:#e5e7eb;border-radius:6px;height:18px;width:100%;overflow:hidden'>"
        f"<div style='background:{color};height:18px;width:{100 * fraction:.1f}%'></div></div>"
        f"<div style='margin-top:6px'>{words.get(status, status)}: step {step}/{total}, {eps_text}{loss} "
        f"({elapsed:.0f} s)</div></div>"
    )


def job_status_markdown(state: Mapping) -> str:
    """The line under the progress bar: the failure, or the finished run's ε and `eval_result`."""
    if state.get("status") == "error":
        return error_md(f"Training failed: {state.get('error')}")
    if state.get("status") == "done":
        result = state.get("result") or {}
        kept = ("its LoRA adapter (not a merged model), tokenizer, privacy card and ledger"
                if result.get("task") == "chat-sft" and (result.get("config") or {}).get("save_adapter_only")
                else "its model, tokenizer, privacy card and ledger")
        eps = result.get("epsilon")
        eps_text = ("no guarantee (non-private)" if eps is None
                    else f"ε = {format_epsilon(eps)}, δ = {format_significant(result.get('delta'), 2, up=True)}")
        better = "; lower is better" if lower_is_better(result.get("metric_name")) else ""
        return (f"**Finished `{result.get('run')}`**: {result.get('metric_name', 'metric')} "
                f"{format_number(result.get('eval_result'), '.3f')} (public-only baseline "
                f"{format_number(result.get('baseline_result'), '.3f')}{better}), {eps_text}. It is listed in the "
                f"Compare and Results tabs as `{APP_RUNS_DIR}/{result.get('run')}`; `{APP_RUNS_DIR}/models/"
                f"{result.get('run')}/` keeps {kept}. Quick runs on small subsets: the numbers are noisy.")
    return ""
