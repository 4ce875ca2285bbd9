"""What DP training needs from the Trainer class, the model and the loss, checked before any step.

Each check either passes or refuses with one line saying what to change: the private Trainer hooks the DP mixin
overrides exist and are called, no subclass replaces `compute_loss`, the model is neither compiled nor built by
`model_init`, a `compute_loss_func` returns one loss per example, and the clipping engine's one-off
checks pass on the first training rows.
"""

from __future__ import annotations

import functools
import inspect
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
import transformers
from accelerate.utils import send_to_device
from transformers import DataCollatorWithFlattening, Trainer

from .clipping import UnsupportedLayerError
from .data import distinct_user_ids, user_id_kinds, user_keys
from .user_column import table_column
from .losses import LOSS_FUNC_PACKED, packed_example_ids, per_example_loss
from .model_kind import is_causal_lm

# The transformers versions the DP mixin is tested with (pyproject.toml declares the same range).
SUPPORTED_TRANSFORMERS = ">=5.24,<6"

# Private Trainer methods the DP mixin overrides or calls, with the leading parameters (after self) each must take.
TRAINER_HOOKS = {
    "_clip_grad_norm": ("model",),
    "_get_grad_norm": ("model", "grad_norm"),
    "_get_num_items_in_batch": ("batch_samples", "device"),
    "_remove_unused_columns": ("dataset", "description"),
    "_save_checkpoint": ("model", "trial"),
}


@functools.lru_cache(maxsize=None)
def check_trainer_hooks(trainer_class: type = Trainer) -> None:
    """Check that `trainer_class` has the private hooks the DP mixin overrides or calls, and that its training loop
    calls the overridden ones (else, e.g., its global clipping would rescale the noised gradient).

    Raises:
        RuntimeError: one line naming the hooks missing, the transformers version and the supported range.
    """
    problems = []
    for name, parameters in TRAINER_HOOKS.items():
        hook = getattr(trainer_class, name, None)
        if not callable(hook):
            problems.append(f"{name} is missing")
            continue
        try:
            found = tuple(inspect.signature(hook).parameters)[1:]
        except (TypeError, ValueError):
            continue
        if found[: len(parameters)] != parameters:
            problems.append(f"{name}{tuple(found)} does not take {parameters}")
    sources = []
    for cls in trainer_class.__mro__:
        if isinstance(cls, type) and issubclass(cls, Trainer):
            try:
                sources.append(inspect.getsource(cls))
            except (OSError, TypeError):  # no source shipped: the names above are all that can be checked
                sources = None
                break
    if sources is not None:
        source = "\n".join(sources)
        problems += [f"its training loop never calls {name}" for name in TRAINER_HOOKS
                     if name != "_remove_unused_columns" and f"self.{name}(" not in source]
    if problems:
        raise RuntimeError(
            f"hf_dp's DP trainers support transformers{SUPPORTED_TRANSFORMERS}; the installed transformers "
            f"{transformers.__version__} has a {trainer_class.__name__} where {'; '.join(problems)}: install a "
            f"supported version (pip install 'transformers{SUPPORTED_TRANSFORMERS}')."
        )
    if trainer_class is Trainer and not version_supported(transformers.__version__):
        warnings.warn(f"hf_dp is tested with transformers{SUPPORTED_TRANSFORMERS}, not {transformers.__version__}: "
                      "DPTrainer's Trainer hooks exist there, but install a tested version if anything misbehaves.",
                      stacklevel=3)


def version_supported(version: str) -> bool:
    from packaging.specifiers import SpecifierSet

    return SpecifierSet(SUPPORTED_TRANSFORMERS).contains(version, prereleases=True)


def check_no_loss_override(trainer_class: type, known: tuple = ()) -> None:
    """A `compute_loss` override would be ignored by the DP step (it needs one loss per example): refused, unless
    the class defining it is `Trainer` or one of `known` (base trainers whose loss the DP trainer reproduces)."""
    owner = next(cls for cls in trainer_class.__mro__ if "compute_loss" in vars(cls))
    if owner is not Trainer and owner not in known:
        raise ValueError(
            f"{trainer_class.__name__} overrides compute_loss (in {owner.__name__}), which DP training cannot use (it "
            "clips each unit's gradient, so it needs one loss per example, not a batch loss): remove the override "
            "and pass compute_loss_func=f, where f(outputs, labels, num_items_in_batch=None) returns a (batch,) "
            "tensor."
        )


def check_model(model, model_init) -> None:
    if model_init is not None:
        raise ValueError("model_init: DP training attaches its per-unit clipping to the model at construction and "
                         "Trainer would replace that model in train(); pass model=model_init() instead.")
    if isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
        raise ValueError(
            "model is a torch.compile wrapper: the per-unit clipping hooks into the model's layers, which makes the "
            "compiled graph break and recompile at every batch shape (slower, not faster); pass the model itself "
            "(model._orig_mod)."
        )


def check_per_example(losses, rows: int) -> None:
    """A `compute_loss_func` result must be `(rows,)`: one loss per example."""
    if not (torch.is_tensor(losses) and tuple(losses.shape) == (rows,)):
        shape = tuple(losses.shape) if torch.is_tensor(losses) else type(losses).__name__
        raise ValueError(
            f"compute_loss_func returned {shape} for a batch of {rows} examples: DP training clips each unit's "
            f"gradient, so it needs one loss per example, shape ({rows},) (e.g. reduction='none', then each "
            "example's mean over its tokens); return that, or drop compute_loss_func."
        )


def probe_batch(dataset, data_collator, *, rows: int, device) -> dict:
    """The first training rows (`dataset` with only the model's columns) collated like a micro-batch (at most
    `rows`, 2 to 4 of them), for the batch-independence, loss and clipping probes."""
    examples = [dataset[i] for i in range(min(len(dataset), rows, 4))]
    try:
        features = data_collator(examples)
    except (ValueError, TypeError, KeyError, RuntimeError) as error:  # e.g. rows of several lengths, no padding
        reason = (str(error).strip().splitlines() or [""])[0]
        raise ValueError(f"The data collator ({type(data_collator).__name__}) cannot batch the first training "
                         f"rows ({type(error).__name__}: {reason}): rows of different lengths need a padding collator; "
                         "pass processing_class=tokenizer (Trainer then pads with DataCollatorWithPadding) or a "
                         "data_collator that pads.") from error
    if packed_example_ids(features) is not None:
        # Packed into one row: the probe perturbs one row and watches the others, so give it one example per
        # row (each collated alone, cut to the shortest).
        singles = [data_collator([example]) for example in examples]
        width = min(single["position_ids"].shape[-1] for single in singles)
        features = {key: torch.cat([single[key][:, :width] for single in singles])
                    for key, value in singles[0].items() if torch.is_tensor(value) and value.dim() == 2}
    return send_to_device(features, device)


def check_loss_func(model, loss_func, data_collator, features: dict) -> None:
    """Refuse a `compute_loss_func` that does not return one loss per example (tried on the probe batch: it only
    decides whether to train, nothing is released)."""
    if loss_func is None:
        return
    if isinstance(data_collator, DataCollatorWithFlattening):
        raise ValueError(LOSS_FUNC_PACKED)
    rows = next(v.shape[0] for v in features.values() if torch.is_tensor(v) and v.dim() > 0)
    inputs = {k: v for k, v in features.items() if k != "labels"}
    was_training = model.training
    try:
        with torch.no_grad():
            outputs = model(**inputs)
            losses = loss_func(outputs, features.get("labels"), num_items_in_batch=None)
    except Exception as error:
        reason = (str(error).strip().splitlines() or [""])[0]
        raise ValueError(f"compute_loss_func failed on the first training rows ({type(error).__name__}: "
                         f"{reason}); DP training calls it as compute_loss_func(outputs, labels, "
                         "num_items_in_batch=None) and needs one loss per example, shape (batch,).") from error
    finally:
        model.train(was_training)
    check_per_example(losses, rows)


def verify_clipping(model, clipper, features: dict, *, loss_func, dataset, causal_lm: bool) -> None:
    """Run the clipper's one-off checks (every gradient covered by a rule, every layer's rows attributed to their
    examples) on the probe rows, before any step: the first training step then needs no second backward pass and no
    kept graph, so it costs the memory of every other step. Only decides whether to train: the gradients are
    discarded and nothing is released."""
    inputs = {k: v for k, v in features.items() if k != "labels"}
    labels = features.get("labels")
    if not any(param.requires_grad for param in model.parameters()):
        raise ValueError("Every parameter of the model is frozen (requires_grad=False): there is nothing to train; "
                         "unfreeze the layers to fine-tune (param.requires_grad_(True)), or add trainable adapters "
                         "(peft's get_peft_model, or peft_config).")
    if labels is None:  # the first step says what is missing
        return
    was_training = model.training
    model.train()
    try:
        outputs = model(**inputs)
        check_outputs(outputs, model, loss_func)
        logits = getattr(outputs, "logits", None)
        if torch.is_tensor(logits) and logits.dim() == 2 and logits.shape[-1] > 1 and labels.dim() == 1:
            if labels.is_floating_point():
                raise ValueError(f"The class labels are floats (e.g. {labels[0].item()!r}) for a head of "
                                 f"{logits.shape[-1]} outputs: cross-entropy needs integer class ids 0.."
                                 f"{logits.shape[-1] - 1}; cast the label column to int (or use num_labels=1 for "
                                 "regression).")
            check_class_labels(dataset, logits.shape[-1])
        if loss_func is not None:
            losses = loss_func(outputs, labels, num_items_in_batch=None).float()
        else:
            losses = per_example_loss(outputs.logits, labels, causal_lm=causal_lm)
        clipper.backward(losses, max_grad_norm=1.0)
    except UnsupportedLayerError as error:
        if half_precision_on_cpu(model):
            raise UnsupportedLayerError(f"{FP16_ON_CPU} (What the clipping check saw: {' '.join(str(error).split())})"
                                        ) from error
        raise
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)


FP16_ON_CPU = ("The model is in float16 on the CPU, where one example's float16 rounding depends on the other rows of "
               "its batch, so the per-example check sees the batch mixed: train in float32 on the CPU (model.float(), "
               "or bfloat16), or in float16 on a GPU.")


def half_precision_on_cpu(model) -> bool:
    """Some trainable parameter is float16 on the CPU."""
    return any(param.requires_grad and param.dtype == torch.float16 and param.device.type == "cpu"
               for param in model.parameters())


def check_outputs(outputs, model, loss_func) -> None:
    """Refuse a forward that returns no `.logits` (a bare tensor, a tuple) when DP training's own loss reads them."""
    if loss_func is None and not torch.is_tensor(getattr(outputs, "logits", None)):
        raise ValueError(f"{type(model).__name__}'s forward returned {type(outputs).__name__}, with no logits: DP "
                         "training reads outputs.logits for its per-example loss; return a ModelOutput (e.g. "
                         "transformers' SequenceClassifierOutput(logits=...) or CausalLMOutput(logits=...)), or pass "
                         "compute_loss_func=f that reads your outputs and returns one loss per example.")


def check_eval_users(eval_dataset, train_dataset, user_id_column: str) -> None:
    """Refuse evaluation data that shares users with the training data: Trainer would log its exact metrics on
    private users (`eval_loss` in the logs and `trainer_state.json`), outside the guarantee.

    Evaluation sets without the user column cannot be checked; the card says evaluation results are not covered.
    """
    if user_id_column not in (getattr(train_dataset, "column_names", None) or []):
        return  # the partition says what is missing
    sets = eval_dataset.items() if isinstance(eval_dataset, dict) else [("eval_dataset", eval_dataset)]
    train_users = None
    for name, dataset in sets:
        if user_id_column not in (getattr(dataset, "column_names", None) or []):
            continue
        if train_users is None:
            train_ids = distinct_user_ids(train_dataset, user_id_column)
            train_users, train_kinds = user_keys(train_ids), user_id_kinds(train_ids)
        eval_ids = distinct_user_ids(dataset, user_id_column)
        eval_kinds = user_id_kinds(eval_ids)
        if train_kinds and eval_kinds and set(eval_kinds) != set(train_kinds):
            raise ValueError(
                f"{name}'s user ids ({_kinds(eval_kinds)}) are not of the training data's type "
                f"({_kinds(train_kinds)}) in {user_id_column!r}: the check that they share no user cannot tell 3 "
                "from '3', and Trainer would log exact metrics on any shared user; give both one type where the "
                "rows are built (e.g. str(user_id))."
            )
        shared = user_keys(eval_ids) & train_users
        if shared:
            raise ValueError(
                f"{name} shares {len(shared)} user(s) with the training data (by {user_id_column!r}): Trainer would "
                "log exact metrics on private users, which ε does not cover. Evaluate on held-out users (split by "
                "user, not by row)."
            )


def _kinds(kinds: dict) -> str:
    return ", ".join(f"{kind}s such as {example!r}" for kind, example in kinds.items())


def check_model_state(model) -> None:
    """Refuse models the DP step cannot run: prompt-learning adapters (their virtual tokens are not per-example
    layers the clipping engine has rules for), parameters on the `meta` device (never loaded), tuple outputs."""
    config = getattr(model, "peft_config", None)
    if isinstance(config, dict) and any(getattr(c, "is_prompt_learning", False) for c in config.values()):
        raise ValueError("peft prompt learning (prompt / prefix / p-tuning): its virtual tokens are shared parameters "
                         "the per-unit clipping has no rule for; use LoRA (peft.LoraConfig) or full fine-tuning.")
    batch_norms = [(name, module) for name, module in model.named_modules()
                   if isinstance(module, torch.nn.modules.batchnorm._BatchNorm)
                   or isinstance(module, torch.nn.modules.instancenorm._InstanceNorm) and module.track_running_stats]
    if batch_norms:
        name, module = batch_norms[0]
        raise ValueError(f"Module {name!r} ({type(module).__name__}) uses batch statistics in train mode, so one "
                         "example changes every other example's output and the per-unit clip no longer bounds a "
                         "user's influence: replace it with LayerNorm (trainable or frozen) or a frozen GroupNorm "
                         "(per-example too, but with no clipping rule while trainable) before DP training.")
    meta = [name for name, param in model.named_parameters() if param.is_meta]
    if meta:
        raise ValueError(f"{len(meta)} parameter(s) are on the 'meta' device (e.g. {meta[0]}): the model was never "
                         "loaded; load it with from_pretrained (without device_map='meta' or init_empty_weights).")
    if getattr(getattr(model, "config", None), "return_dict", True) is False:
        raise ValueError("model.config.return_dict=False: the model returns tuples, and DP training reads "
                         "outputs.logits; set model.config.return_dict = True.")


def check_labels(dataset, model) -> None:
    """Refuse training data no loss can learn from, before any ε is spent: no labelled token at all (every label
    -100). Only decides whether to train; nothing is released. (Class labels are checked against the head's real
    width in `verify_clipping`.)"""
    if "labels" not in (getattr(dataset, "column_names", None) or []):
        return
    start = 1 if is_causal_lm(model) else 0  # a causal LM's first label is never a target (the shift)
    read = table_column(dataset, "labels")
    if read is not None and _integer_lists(read[0].type):  # token labels, read through Arrow
        token_labels, has_target, first = True, _token_targets(*read, start=start), None
    else:
        labels = dataset["labels"]
        first = next((label for label in labels if label is not None), None)
        token_labels = isinstance(first, list)
        has_target = token_labels and any(token != -100 for row in labels if row for token in row[start:])
    if token_labels and not has_target:
        raise ValueError("No label in the training data is a target (every label is -100"
                         + (", or only the first token of a row, which a causal LM never predicts" if start else "")
                         + "): every loss would be 0 and the run would train on noise alone. Check the masking "
                         "(e.g. assistant-only or completion-only labels that match nothing) and the truncation "
                         "(a max_length that cuts every labelled token away).")
    if isinstance(first, str):
        raise ValueError(f"The training labels are strings (e.g. {first!r}): map each class to an integer id 0..n-1 "
                         "(e.g. with datasets' class_encode_column) before training.")


def check_class_labels(dataset, num_classes: int) -> None:
    """Refuse class labels outside the classification head's `num_classes` outputs (a cross-entropy error at some
    step otherwise). Only decides whether to train; nothing is released."""
    if "labels" not in (getattr(dataset, "column_names", None) or []):
        return
    read = table_column(dataset, "labels")
    if read is not None and pa.types.is_integer(read[0].type):
        array, indices = read
        labels = pc.fill_null(array, 0).to_numpy()  # a missing label is no class label (0 is one)
        labels = labels if indices is None else labels[indices]
        bad = labels[(labels < 0) | (labels >= num_classes)].tolist()
    else:
        bad = [label for label in dataset["labels"] if isinstance(label, int) and not 0 <= label < num_classes]
    if bad:
        raise ValueError(f"{len(bad)} class label(s) outside 0..{num_classes - 1} (e.g. {bad[0]}): the model's head "
                         f"has {num_classes} outputs; set num_labels to the number of classes or fix the labels.")


def _integer_lists(kind) -> bool:
    """An Arrow list (or large list) of integers: token labels."""
    return (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and pa.types.is_integer(kind.value_type)


def _token_targets(array, indices, *, start: int, block: int = 1 << 16) -> bool:
    """Whether a row of the dataset has a token label other than -100 from position `start` on, read through Arrow a
    block of rows at a time (the first block with one answers): `array` the column over the whole table, `indices`
    the table rows the dataset holds (`None`: all)."""
    selected = None
    if indices is not None:
        selected = np.zeros(len(array), dtype=bool)
        selected[indices] = True
    offset = 0
    for chunk in array.chunks:
        for begin in range(0, len(chunk), block):
            rows = chunk.slice(begin, block)
            lengths = pc.fill_null(pc.list_value_length(rows), 0).to_numpy().astype(np.int64)
            targets = pc.fill_null(pc.not_equal(pc.list_flatten(rows), -100), True).to_numpy(zero_copy_only=False)
            before = np.concatenate([[0], np.cumsum(targets, dtype=np.int64)])  # targets before each token
            ends = np.cumsum(lengths)
            found = before[ends] - before[np.minimum(ends - lengths + start, ends)] > 0
            if selected is not None:
                found &= selected[offset + begin:offset + begin + len(rows)]
            if found.any():
                return True
        offset += len(chunk)
    return False

