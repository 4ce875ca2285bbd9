"""DPSFTTrainer: TRL's `SFTTrainer` with user-level DP, on chat data where one person writes many conversations.

TRL prepares the data as it always does (chat template, `assistant_only_loss` / `completion_only_loss` masks),
keeping the user column, and a row longer than `max_length` keeps its reply (`hf_dp.sft_truncation`); the DP mixin
then partitions the prepared rows by user and runs the DP step.
What SFTTrainer does that DP training cannot keep is refused in one line (`DPSFTConfig`), or replaced:

- the loss: SFTTrainer's `compute_loss` (a fused LM head over the batch) is never called in training; each
  conversation's loss is its mean masked token cross-entropy, so a unit's gradient is exactly its conversations'
  masked loss, clipped per unit;
- the logs: SFTTrainer's training metrics (token accuracy, entropy, token counts) are computed in `compute_loss`
  from the batch; none reaches the logs (the DP step's noised loss and clipped fraction do, covered by ε);
- the model card: the privacy card replaces TRL's card, in checkpoints too.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass, field

try:
    from trl import SFTConfig, SFTTrainer
except ImportError as error:  # pragma: no cover - exercised by the packaging test
    raise ImportError("hf_dp.sft needs TRL: pip install 'hf_dp[trl]'.") from error

from transformers import TrainingArguments

from .user_counts import CONTRIBUTION_BOUND_GRID
from .arguments import DPTrainingArguments
from .card import SFT_METRICS_ITEM
from .checkpoint import read_checkpoint
from .data import bound_rows, check_user_column
from .mechanisms import get_mechanism
from .sft_truncation import KEEP_REPLY, TRUNCATION_MODES, ReplyKeepingMixin
from .trainer import DPTrainerMixin
from .user_column import table_column

logger = logging.getLogger(__name__)

# The TRL versions DPSFTTrainer is tested with (pyproject.toml's `trl` extra declares the same range).
SUPPORTED_TRL = ">=1.16,<1.17"
# What SFTTrainer logs from the training batch (`compute_loss`): never logged by DPSFTTrainer.
SFT_TRAINING_METRICS = ("entropy", "mean_token_accuracy", "num_tokens", "aux_loss")
# transformers 5.24 renames gradient checkpointing to activation checkpointing (the old names are deprecated aliases).
ACTIVATION_CHECKPOINTING = "activation_checkpointing" in {f.name for f in dataclasses.fields(TrainingArguments)}
CHECKPOINTING = "activation_checkpointing" if ACTIVATION_CHECKPOINTING else "gradient_checkpointing"
PREPARE_MARGIN = 4  # rows prepared per row kept: spares for those TRL's truncation leaves without a label
_GENERATION_MARK = re.compile(r"{%-?\s*generation\s*-?%}")


@dataclass
class DPSFTConfig(SFTConfig, DPTrainingArguments):
    r"""
    [`trl.SFTConfig`] plus the privacy fields of [`DPTrainingArguments`], one spelling for each.

    SFTConfig's defaults hold (`bf16`, activation checkpointing on, `max_length`, `assistant_only_loss`, ...), except
    what DP training needs: `per_device_train_batch_size` is unset (sized from the Poisson sample, see
    [`DPTrainingArguments`]) and activation (gradient) checkpointing is non-reentrant (what the clipping engine
    supports). Where transformers has `activation_checkpointing` (5.24 and later), SFTConfig's default is set under
    that name; `gradient_checkpointing` still works as its deprecated alias.

    Raises:
        ValueError: besides [`DPTrainingArguments`]' refusals, one line for each SFT setting that would break DP:
            `packing=True` (rows of several users' examples, the user column dropped; `padding_free=True` keeps
            each example its own positions, loss and user), a `loss_type` other than `"nll"` (`"dft"` weights
            tokens inside `compute_loss`, which DP training does not call), `use_liger_kernel` (its fused loss gives
            no per-example losses), `activation_offloading`, reentrant activation checkpointing, a `max_length` below
            2 (nothing left to learn), `padding_free=True` with a `max_length` (TRL cannot truncate such rows).

    Example:

    ```python
    >>> args = DPSFTConfig("out", target_epsilon=8.0, expected_batch_size=16, assistant_only_loss=True,
    ...                    report_to="none", use_cpu=True)
    >>> (args.per_device_train_batch_size, args.packing, args.activation_checkpointing_kwargs["use_reentrant"])
    (None, False, False)

    ```
    """

    per_device_train_batch_size: int | None = field(
        default=None,
        metadata={"help": "Most rows of one physical pass (memory). Unset: sized from the tail of the Poisson batch."},
    )
    truncation_mode: str = field(
        default=KEEP_REPLY,
        metadata={"help": "How a row longer than max_length is cut: 'keep_reply' (default: the start of its context "
                          "goes, its labelled reply stays), or TRL's 'keep_start' (the end goes: a long prompt can "
                          "leave no reply, and the row is dropped).", "choices": list(TRUNCATION_MODES)},
    )
    if ACTIVATION_CHECKPOINTING:  # SFTConfig's default (on) goes to the new name, so no deprecation warning is shown
        gradient_checkpointing: bool | None = field(
            default=None, metadata={"help": "Deprecated alias of --activation_checkpointing (on by default here).",
                                    "nargs": "?", "const": True})

    def __post_init__(self):
        if ACTIVATION_CHECKPOINTING:
            if self.activation_checkpointing is None and self.gradient_checkpointing is None:
                self.activation_checkpointing = True  # SFTConfig's default
            if self.activation_checkpointing_kwargs is None and self.gradient_checkpointing_kwargs is None:
                self.activation_checkpointing_kwargs = {"use_reentrant": False}
        elif self.gradient_checkpointing_kwargs is None:
            self.gradient_checkpointing_kwargs = {"use_reentrant": False}
        max_length = self.max_length
        if max_length is not None and not (isinstance(max_length, int) and not isinstance(max_length, bool)
                                           and max_length >= 2):
            raise ValueError(f"Invalid DPSFTConfig: max_length={max_length!r}: a conversation needs a token and the "
                             "next one to learn from, and a shorter cut leaves every loss 0 (noise alone, ε spent); "
                             "use "
                             "a whole number >= 2 (e.g. 1024), or None for no truncation.")
        if self.truncation_mode not in TRUNCATION_MODES:
            raise ValueError(f"Invalid DPSFTConfig: truncation_mode={self.truncation_mode!r}: use one of "
                             f"{', '.join(map(repr, TRUNCATION_MODES))} ('keep_reply' keeps each row's reply).")
        super().__post_init__()
        problems = []
        if self.padding_free and self.max_length is not None:
            problems.append(f"padding_free=True with max_length={self.max_length}: TRL does not truncate padding-free "
                            "rows (and packing, which would, is refused under DP); set max_length=None and truncate "
                            "the conversations beforehand, or padding_free=False.")
        if self.packing:
            problems.append("packing=True: packed rows hold several users' examples and lose the user column; "
                            "use padding_free=True (exact: each example keeps its positions, loss and user) or "
                            "packing=False.")
        if self.loss_type != "nll":
            problems.append(f"loss_type={self.loss_type!r}: DP training computes each example's mean token "
                            "cross-entropy itself and never calls SFTTrainer's compute_loss; use loss_type='nll'.")
        if self.use_liger_kernel:
            problems.append("use_liger_kernel=True: its fused loss kernel returns no per-example losses; turn it off.")
        if self.activation_offloading:
            problems.append("activation_offloading=True: not supported with the per-unit clipping; use "
                            "gradient_checkpointing (non-reentrant) to save memory instead.")
        if self.gradient_checkpointing and (self.gradient_checkpointing_kwargs or {}).get("use_reentrant", False):
            problems.append(f"{CHECKPOINTING}_kwargs={{'use_reentrant': True}}: the clipping engine needs "
                            "non-reentrant checkpointing; set use_reentrant=False.")
        if problems:
            raise ValueError("Invalid DPSFTConfig: " + problems[0] if len(problems) == 1 else
                             "Invalid DPSFTConfig:\n  - " + "\n  - ".join(problems))


class DPSFTTrainer(DPTrainerMixin, ReplyKeepingMixin, SFTTrainer):
    r"""
    TRL's [`trl.SFTTrainer`] with user-level (or example-level) DP-SGD: `DPTrainerMixin` on `SFTTrainer`.

    Takes SFTTrainer's arguments with `args` a [`DPSFTConfig`]; the training dataset needs a user column
    (`args.user_id_column`) beside `messages` (conversational) or `text` / `prompt`+`completion`. TRL prepares it
    (chat template, masks, truncation), then each prepared row is one example of its user: ULS clips each user's
    mean over their conversations, ELS each conversation. LoRA through `peft_config` works as in SFTTrainer. The
    ledger, ε, refusals, privacy card and `hf-dp publish` are those of [`DPTrainer`].

    Raises:
        ValueError: `args` not a [`DPSFTConfig`]; a user column missing from the dataset or dropped by the
            preparation; and everything [`DPTrainer`] refuses.
    """

    known_loss_overrides = (SFTTrainer,)  # its compute_loss is replaced by per-example losses in the DP step

    def __init__(self, model, args: DPSFTConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, compute_loss_func=None, compute_metrics=None,
                 callbacks=None, optimizers=(None, None), optimizer_cls_and_kwargs=None,
                 preprocess_logits_for_metrics=None, quantization_config=None, peft_config=None,
                 formatting_func=None, *, privacy_card_kwargs: dict | None = None):
        if not isinstance(args, DPSFTConfig):
            raise TypeError("DPSFTTrainer needs DPSFTConfig arguments (SFTConfig plus the privacy fields).")
        if train_dataset is None:
            raise ValueError("DP training needs a train_dataset with a user column to account privacy.")
        check_user_column(train_dataset, args.user_id_column)  # a stream, not a Dataset, no user column: one line
        check_processing_class(model, processing_class)
        prepares = not (args.dataset_kwargs or {}).get("skip_prepare_dataset", False)
        if prepares:
            check_chat_template(processing_class, args)
            train_dataset = prepare_rows(train_dataset, args, formatting_func, "train_dataset")
            if isinstance(eval_dataset, dict):
                eval_dataset = {key: prepare_rows(value, args, formatting_func, f"eval_dataset[{key!r}]")
                                for key, value in eval_dataset.items()}
            elif eval_dataset is not None:
                eval_dataset = prepare_rows(eval_dataset, args, formatting_func, "eval_dataset")
        self._rows_given = len(train_dataset)  # the rows within the bound, once drawn (_prepare_dataset)
        try:
            super().__init__(model, args, data_collator, train_dataset, eval_dataset, processing_class,
                             compute_loss_func, compute_metrics, callbacks, optimizers, optimizer_cls_and_kwargs,
                             preprocess_logits_for_metrics, quantization_config, peft_config, formatting_func,
                             privacy_card_kwargs=privacy_card_kwargs)
        except RuntimeError as error:  # TRL's check of the assistant masks, row by row
            if "no assistant tokens" not in str(error):
                raise
            raise ValueError(_NO_ASSISTANT_MASK) from error
        except Exception as error:  # the chat template (jinja) failing on a row
            if not type(error).__module__.startswith("jinja2"):
                raise
            reason = (str(error).strip().splitlines() or [""])[0]
            raise ValueError(f"The chat template failed on a training or evaluation row ({type(error).__name__}: "
                             f"{reason}): check that every message's role and content are ones this template "
                             "accepts.") from error

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        """TRL's preparation (chat template, tokenization, truncation), of the training rows within the bound only:
        at most G rows per user (G's largest value, 256, for `contribution_bound="auto"`, whose ε-DP draw then reads
        the capped counts), drawn with the run's data secret, so the rows beyond G are never tokenized."""
        if dataset_name == "train" and isinstance(args, DPSFTConfig):
            self._train_to_prepare = (dataset, processing_class, args, packing, formatting_func, dataset_name)
            dataset = bound_before_preparing(dataset, args, self._data_secret)
            self._rows_given = len(dataset)
        return super()._prepare_dataset(dataset, processing_class, args, packing, formatting_func, dataset_name)

    def _resume_privacy_state(self, folder: str) -> None:
        """A checkpoint with another data secret chose other rows within the bound: prepare those again first."""
        saved = read_checkpoint(folder).data_secret
        given = getattr(self, "_train_to_prepare", None)
        if given is not None and saved is not None and saved != self._data_secret:
            secret, self._data_secret = self._data_secret, saved
            try:
                self._user_dataset = self._prepare_dataset(*given)
            finally:
                self._data_secret = secret  # the mixin replaces it, and partitions the rows prepared here
        super()._resume_privacy_state(folder)

    def _partition_users(self, data_secret: str) -> None:
        args = self.args
        given, prepared = getattr(self, "_rows_given", None), len(self._user_dataset)
        if given and not prepared:
            raise ValueError(f"SFTTrainer's preparation left none of the {given} training rows: it drops rows with no "
                             f"labelled token once truncated to max_length={args.max_length} "
                             f"(truncation_mode={args.truncation_mode!r}), which cut every reply away; "
                             "raise max_length "
                             "(e.g. 1024, or None for no truncation), use truncation_mode='keep_reply', or check "
                             "completion_only_loss and assistant_only_loss.")
        if given and prepared < given:
            logger.warning("SFTTrainer dropped %d of the %d training rows: no labelled token was left to learn once "
                           "truncated to max_length=%s (truncation_mode=%r; 'keep_reply' or a larger max_length "
                           "keeps them).", given - prepared, given, args.max_length, args.truncation_mode)
        if args.user_id_column not in self._user_dataset.column_names:
            raise ValueError(f"SFTTrainer's dataset preparation dropped the user column {args.user_id_column!r} "
                             f"(columns left: {self._user_dataset.column_names}): with skip_prepare_dataset, keep it "
                             "in the prepared dataset.")
        super()._partition_users(data_secret)

    def write_privacy_card(self, output_dir: str | None = None, **card_kwargs):
        """DPTrainer's card, saying which of SFTTrainer's metrics were dropped."""
        extra = [*card_kwargs.pop("extra_not_covered", self.privacy_card_kwargs.get("extra_not_covered", ())),
                 SFT_METRICS_ITEM]
        return super().write_privacy_card(output_dir, extra_not_covered=extra, **card_kwargs)

    def log(self, logs: dict, start_time: float | None = None) -> None:
        """DPTrainer's logs; SFTTrainer's metrics of the training batch are dropped (they are not covered by ε),
        its evaluation metrics (on held-out users) kept."""
        self._metrics["train"].clear()
        for key in SFT_TRAINING_METRICS:
            logs.pop(key, None)
        super().log(logs, start_time)


_NO_ASSISTANT_MASK = (
    "assistant_only_loss=True, but the chat template marked no assistant token in a training or evaluation row: "
    "each kept conversation has an assistant turn, so its content must be empty or the template's {% generation %} "
    "marks miss it; give every assistant turn some content, or set assistant_only_loss=False (prompt/completion rows "
    "with completion_only_loss need no marks)."
)


def bound_before_preparing(dataset, args: DPSFTConfig, secret):
    """The training rows SFTTrainer needs to prepare: at most `PREPARE_MARGIN`·G per user (every row at example
    level, or without a bound). Each user's rows are drawn from (secret, user id) alone, like the partition's, which
    then draws G among those the preparation kept: a row TRL drops (no labelled token left after truncation) rarely
    costs its user, and the guarantee is the same (what is kept depends on the user's own rows only). With
    `redraw_rows` every row is prepared: each step draws G among them all."""
    bound = args.contribution_bound
    if bound is None or not get_mechanism(args.mechanism).protects_users or args.redraw_rows:
        return dataset
    cap = CONTRIBUTION_BOUND_GRID[-1] if bound == "auto" else min(CONTRIBUTION_BOUND_GRID[-1],
                                                                    PREPARE_MARGIN * int(bound))
    return bound_rows(dataset, args.user_id_column, cap, secret, "rows before preparation")


def check_processing_class(model, processing_class) -> None:
    """Without a processing class SFTTrainer loads one from the model's name: refuse a model that has none."""
    if processing_class is not None or isinstance(model, str):
        return
    name = getattr(getattr(model, "config", None), "_name_or_path", None)
    if not name:
        raise ValueError("processing_class=None, and the model has no name or path to load its tokenizer from (it "
                         "was built from a config): pass processing_class=AutoTokenizer.from_pretrained(...), a "
                         "tokenizer with a chat template for conversational rows.")


def check_chat_template(processing_class, args: DPSFTConfig) -> None:
    """`assistant_only_loss` needs `{% generation %}` marks in the chat template: refused up front without them."""
    if not args.assistant_only_loss or processing_class is None:
        return
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    template = args.chat_template_path or getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and "{%" in template and not _GENERATION_MARK.search(template):
        raise ValueError("assistant_only_loss=True, but the tokenizer's chat template has no {% generation %} marks, "
                         "so no assistant token would be labelled; use prompt/completion rows with "
                         "completion_only_loss (no marks needed), or a template with the marks.")


def prepare_rows(dataset, args: DPSFTConfig, formatting_func, name: str):
    """Check every row before TRL and the chat template read it, in one line naming the row and what to fix; under
    `assistant_only_loss`, drop conversations with no assistant turn (nothing to learn; TRL would stop on them).

    Each row is checked on its own content and dropped on it alone (no statistic of the data is used), before the
    user partition: the privacy accounting is that of the rows kept.

    Raises:
        TypeError: a streamed dataset (materialise it first).
        ValueError: no `messages`, `prompt`+`completion` or `dataset_text_field` column; a conversation that is not
            a non-empty list of messages, each with a string role and a string content (`None` only beside
            `tool_calls`); an empty completion; a text that is not a string.
    """
    if name == "train_dataset":
        check_user_column(dataset, args.user_id_column)
    else:
        _check_stream(dataset, name)
    columns = list(dataset.column_names)
    if "input_ids" in columns or formatting_func is not None:
        return dataset  # already tokenized, or formatted by the caller's function: TRL takes it as is
    if "messages" in columns:
        fields = ["messages"]
    elif "prompt" in columns or "completion" in columns:
        if not {"prompt", "completion"} <= set(columns):
            raise ValueError(f"{name} has a {'prompt' if 'prompt' in columns else 'completion'!r} column but no "
                             f"{'completion' if 'prompt' in columns else 'prompt'!r} column (columns: {columns}): SFT "
                             "learns a completion from its prompt; give both.")
        fields = ["prompt", "completion"]
    elif args.dataset_text_field in columns:
        fields = [args.dataset_text_field]
    else:
        raise ValueError(f"{name} has no {args.dataset_text_field!r} column, nor 'messages' or 'prompt'+'completion' "
                         f"(columns: {columns}): set dataset_text_field to the text column, or give conversations.")
    if fields != ["messages"] and _strings_pass(dataset, fields):
        return dataset  # every row passes the checks below: decided in Arrow
    no_reply = []
    index = 0
    for batch in dataset.select_columns(fields).iter(batch_size=1000):
        for values in zip(*(batch[f] for f in fields)):
            row = dict(zip(fields, values))
            if fields == [args.dataset_text_field]:
                if not isinstance(values[0], str):
                    raise ValueError(f"{name} row {index}: {fields[0]!r} is {_kind(values[0])}, not a string; fill "
                                     "or drop such rows.")
            elif fields == ["prompt", "completion"] and all(isinstance(v, str) for v in values):
                if not values[1]:
                    raise ValueError(f"{name} row {index}: the completion is an empty string; drop such rows.")
            else:
                for key, value in row.items():
                    check_conversation(value, f"{name} row {index}: {key!r}")
                if fields == ["messages"] and args.assistant_only_loss and \
                        not any(m.get("role") == "assistant" for m in row["messages"]):
                    no_reply.append(index)
            index += 1
    if no_reply and len(no_reply) == len(dataset):
        raise ValueError(f"No conversation of {name} has an assistant turn (e.g. row {no_reply[0]}: "
                         f"{[m.get('role') for m in dataset[no_reply[0]]['messages']]}): under assistant_only_loss "
                         "there is nothing to learn; give the conversations their assistant replies, or set "
                         "assistant_only_loss=False to train on every token.")
    if no_reply:
        logger.warning("Dropping %d of the %d conversations of %s: no assistant turn, so nothing to learn under "
                       "assistant_only_loss.", len(no_reply), len(dataset), name)
        dropped = set(no_reply)
        dataset = dataset.select([i for i in range(len(dataset)) if i not in dropped])
    return dataset


def _strings_pass(dataset, fields: list[str]) -> bool:
    """Whether every row passes [`prepare_rows`]' checks of a text or prompt/completion dataset, decided in Arrow:
    string columns without a missing value (and no empty completion). `False` sends the rows to the row walk, which
    names the first row that fails."""
    import pyarrow as pa
    import pyarrow.compute as pc

    for name in fields:
        read = table_column(dataset, name)
        if read is None or not (pa.types.is_string(read[0].type) or pa.types.is_large_string(read[0].type)):
            return False
        array, indices = read
        bad = pc.is_null(array)
        if name == "completion":
            bad = pc.or_(bad, pc.fill_null(pc.equal(pc.utf8_length(array), 0), False))
        bad = bad.to_numpy(zero_copy_only=False)
        if (bad if indices is None else bad[indices]).any():
            return False
    return True


def _check_stream(dataset, name: str) -> None:
    if getattr(dataset, "column_names", None) is None or not hasattr(dataset, "select_columns") \
            or not hasattr(dataset, "__len__"):
        raise TypeError(f"{name} is a {type(dataset).__name__}, not a datasets.Dataset: materialise it (e.g. "
                        "Dataset.from_generator, or stream.take(n) first for a datasets stream).")


def check_conversation(messages, where: str) -> None:
    """Refuse, in one line starting with `where`, anything but a non-empty list of messages with a string role and
    string (or list) content, `None` only beside `tool_calls`."""
    if isinstance(messages, str):
        raise ValueError(f"{where} is a string, not a conversation (a list of {{'role', 'content'}} messages): use "
                         "the 'text' column (dataset_text_field) for plain text, or build the messages.")
    if not isinstance(messages, list) or not messages:
        shown = "an empty list" if isinstance(messages, list) else _kind(messages)
        raise ValueError(f"{where} is {shown}, not a conversation: give at least one {{'role', 'content'}} message, "
                         "or drop the row.")
    for number, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"{where}, message {number}, is {_kind(message)}, not a {{'role', 'content'}} dict.")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{where}, message {number}, has no role (found {_kind(role)}): give every message a "
                             "role such as 'user' or 'assistant'.")
        if content is None and not message.get("tool_calls"):
            raise ValueError(f"{where}, message {number} ({role}), has no content: give it a string (an empty one "
                             "if need be), or drop the row.")
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(f"{where}, message {number} ({role}), has content {_kind(content)}, not a string: the "
                             "chat template would render it as text it was never meant to be; convert it.")


def _kind(value) -> str:
    return "None" if value is None else f"of type {type(value).__name__}"
