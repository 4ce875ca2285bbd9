"""DPSFTTrainer: TRL's `SFTTrainer` with user-level DP, on chat data where one person writes many conversations.

TRL prepares the data as it always does (chat template, `assistant_only_loss` / `completion_only_loss` masks,
truncation), keeping the user column; the DP mixin then partitions the prepared rows by user and runs the DP step.
What SFTTrainer does that DP training cannot keep is refused in one line (`DPSFTConfig`), or replaced:

- the loss: SFTTrainer's `compute_loss` (a fused LM head over the batch) is never called in training; each
  conversation's loss is its mean masked token cross-entropy, so a unit's gradient is exactly its conversations'
  masked loss, clipped per unit;
- the logs: SFTTrainer's training metrics (token accuracy, entropy, token counts) are computed in `compute_loss`
  from the batch; none reaches the logs (the DP step's noised loss and clipped fraction do, covered by ε);
- the model card: the privacy card replaces TRL's card, in checkpoints too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

try:
    from trl import SFTConfig, SFTTrainer
except ImportError as error:  # pragma: no cover - exercised by the packaging test
    raise ImportError("hf_dp.sft needs TRL: pip install 'hf_dp[trl]'.") from error

from .arguments import DPTrainingArguments
from .trainer import DPTrainerMixin

# The TRL versions DPSFTTrainer is tested with (pyproject.toml's `trl` extra declares the same range).
SUPPORTED_TRL = ">=1.16,<1.17"
# What SFTTrainer logs from the training batch (`compute_loss`): never logged by DPSFTTrainer.
SFT_TRAINING_METRICS = ("entropy", "mean_token_accuracy", "num_tokens", "aux_loss")


@dataclass
class DPSFTConfig(SFTConfig, DPTrainingArguments):
    r"""
    [`trl.SFTConfig`] plus the privacy fields of [`DPTrainingArguments`], one spelling for each.

    SFTConfig's defaults hold (`bf16`, `gradient_checkpointing`, `max_length`, `assistant_only_loss`, ...), except
    what DP training needs: `per_device_train_batch_size` is unset (sized from the Poisson sample, see
    [`DPTrainingArguments`]) and gradient checkpointing is non-reentrant (what the clipping engine supports).

    Raises:
        ValueError: besides [`DPTrainingArguments`]' refusals, one line for each SFT setting that would break DP:
            `packing=True` (rows of several users' examples, the user column dropped; `padding_free=True` keeps
            each example its own positions, loss and user), a `loss_type` other than `"nll"` (`"dft"` weights
            tokens inside `compute_loss`, which DP training does not call), `use_liger_kernel` (its fused loss gives
            no per-example losses), `activation_offloading`, reentrant gradient checkpointing.

    Example:

    ```python
    >>> args = DPSFTConfig("out", target_epsilon=8.0, expected_batch_size=16, assistant_only_loss=True,
    ...                    report_to="none", use_cpu=True)
    >>> (args.per_device_train_batch_size, args.packing, args.gradient_checkpointing_kwargs["use_reentrant"])
    (None, False, False)

    ```
    """

    per_device_train_batch_size: int | None = field(
        default=None,
        metadata={"help": "Most rows of one physical pass (memory). Unset: sized from the tail of the Poisson batch."},
    )

    def __post_init__(self):
        if self.gradient_checkpointing_kwargs is None:
            self.gradient_checkpointing_kwargs = {"use_reentrant": False}
        super().__post_init__()
        problems = []
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
            problems.append("gradient_checkpointing_kwargs={'use_reentrant': True}: the clipping engine needs "
                            "non-reentrant checkpointing; set use_reentrant=False.")
        if problems:
            raise ValueError("Invalid DPSFTConfig: " + problems[0] if len(problems) == 1 else
                             "Invalid DPSFTConfig:\n  - " + "\n  - ".join(problems))


class DPSFTTrainer(DPTrainerMixin, SFTTrainer):
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
        column = args.user_id_column
        if train_dataset is not None and column not in (getattr(train_dataset, "column_names", None) or []):
            raise ValueError(f"The training dataset has no user column {column!r} (columns: "
                             f"{getattr(train_dataset, 'column_names', None)}): add the id of the user who wrote "
                             "each conversation, or set user_id_column.")
        super().__init__(model, args, data_collator, train_dataset, eval_dataset, processing_class,
                         compute_loss_func, compute_metrics, callbacks, optimizers, optimizer_cls_and_kwargs,
                         preprocess_logits_for_metrics, quantization_config, peft_config, formatting_func,
                         privacy_card_kwargs=privacy_card_kwargs)

    def _partition_users(self, data_secret: str) -> None:
        column = self.args.user_id_column
        if column not in self._user_dataset.column_names:
            raise ValueError(f"SFTTrainer's dataset preparation dropped the user column {column!r} "
                             f"(columns left: {self._user_dataset.column_names}): with skip_prepare_dataset, keep it "
                             "in the prepared dataset.")
        super()._partition_users(data_secret)

    def write_privacy_card(self, output_dir: str | None = None, **card_kwargs):
        """DPTrainer's card, saying which of SFTTrainer's metrics were dropped."""
        dropped = ("**SFTTrainer's training metrics.** TRL computes token accuracy, entropy and token counts from "
                   "each training batch; they were not logged, since ε would not cover them.")
        extra = [*card_kwargs.pop("extra_not_covered", self.privacy_card_kwargs.get("extra_not_covered", ())), dropped]
        return super().write_privacy_card(output_dir, extra_not_covered=extra, **card_kwargs)

    def log(self, logs: dict, start_time: float | None = None) -> None:
        """DPTrainer's logs; SFTTrainer's metrics of the training batch are dropped (they are not covered by ε),
        its evaluation metrics (on held-out users) kept."""
        self._metrics["train"].clear()
        for key in SFT_TRAINING_METRICS:
            logs.pop(key, None)
        super().log(logs, start_time)
