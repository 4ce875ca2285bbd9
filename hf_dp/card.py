"""The privacy model card: a `huggingface_hub.ModelCard` that states the guarantee.

The card is rendered from `hf_dp/templates/privacy_card.md` (package data; also linked
from `model_cards/`) with Jinja, the way `huggingface_hub.repocard` renders its own
templates. It has

- YAML front matter the Hub understands: `library_name`, `base_model`, `pipeline_tag`,
  `datasets`, `tags` (`differential-privacy`, `dp-sgd`, `user-level-dp` or
  `example-level-dp`, and `dp-uls` / `dp-els`), a `model-index` with the DP model's result, and a
  machine-readable `privacy:` block that is exactly the trainer's privacy report (its `mechanism` is a key of
  [`~hf_dp.vocabulary.MECHANISMS`]), plus a `dp_evaluation:` block with the evaluation figures under the names
  of [`~hf_dp.vocabulary.EVAL_KEYS`] (`metric_name`, `eval_result`, `baseline_result`, `non_private_result`),
  the same names as this module's arguments and the result JSON;
- a plain statement of the guarantee at its unit, the parameters, the accountant and its
  error bounds (for ELS, the loose group-privacy ε beside the mixture-of-Gaussians ε),
  the evaluation beside the public-only baseline, and, in one section, what the guarantee
  covers and what it does not (after Tramèr, Kamath and Carlini 2024; `docs/guarantee.md` explains each item).

Stated numbers never flatter the guarantee: ε and δ (and q) are rounded up, σ and the lower
bound of ε down; the user and example counts are shown rounded to 2 significant figures and
said not to be covered. [`write_privacy_card`] saves the ledger beside the card
(`dp_ledger.json`), from which `hf-dp publish` recomputes ε before any upload.

Writing a card is post-processing: it never changes the guarantee, it only reports it.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import numbers
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import jinja2
from huggingface_hub import EvalResult, ModelCard, ModelCardData

from .formatting import format_lower_bound, format_number, format_significant, format_upper_bound
from .mechanisms import MECHANISMS, get_mechanism, registered_mechanisms
from .vocabulary import EVAL_KEYS, LEDGER_FILE  # LEDGER_FILE: the card's companion

__all__ = ["render_privacy_card", "write_privacy_card", "round_count", "LEDGER_FILE", "TEMPLATE_NAME"]

TEMPLATE_NAME = "privacy_card.md"

# hf_dp.formatting's number formatters, with the card's words for a missing number. Each rounds in the direction
# that never flatters the guarantee: ε up (`_fmt_up`), lower bounds down, δ and q up, σ down (`_fmt_sig`).
_NOT_REPORTED = "not reported"
_fmt = functools.partial(format_number, missing=_NOT_REPORTED)
_fmt_up = functools.partial(format_upper_bound, missing=_NOT_REPORTED)
_fmt_down = functools.partial(format_lower_bound, missing=_NOT_REPORTED)
_fmt_sig = functools.partial(format_significant, missing=_NOT_REPORTED)

# The report's keys, in the order the `privacy:` block lists them.
REPORT_KEYS = (
    "no_guarantee", "privacy_unit", "mechanism", "sampling", "epsilon", "delta", "delta_accountant",
    "delta_floating_point", "noise_reach", "epsilon_lower", "epsilon_estimate", "target_epsilon",
    "epsilon_group_privacy", "noise_multiplier",
    "logging_noise_multiplier", "max_loss", "effective_noise_multiplier", "sample_rate",
    "expected_batch_size", "steps", "max_grad_norm", "adaptive_clipping", "final_max_grad_norm",
    "target_unclipped_quantile", "clipping_learning_rate", "clipping_count_noise", "contribution_bound", "redraw_rows",
    "num_users", "num_examples", "accountant", "mechanism_description", "noise_seed", "noise_source",
)
# Required when `adaptive_clipping` is true: what the card says about how C was chosen.
_ADAPTIVE_KEYS = (
    "final_max_grad_norm", "target_unclipped_quantile", "clipping_learning_rate", "clipping_count_noise",
)
_REQUIRED_KEYS = (
    "epsilon", "delta", "privacy_unit", "mechanism", "noise_multiplier", "sample_rate",
    "steps", "max_grad_norm",
)
# Report fields that must be numbers when present (a string here would reach a format code).
_NUMERIC_KEYS = (
    "epsilon", "delta", "delta_accountant", "delta_floating_point", "noise_reach", "epsilon_lower",
    "epsilon_estimate", "target_epsilon", "epsilon_group_privacy", "noise_multiplier", "logging_noise_multiplier",
    "max_loss", "effective_noise_multiplier", "sample_rate",
    "expected_batch_size", "steps", "max_grad_norm", "contribution_bound", "contribution_bound_epsilon",
    "num_users", "num_examples", *_ADAPTIVE_KEYS,
)


def _template_text() -> str:
    return (importlib.resources.files("hf_dp") / "templates" / TEMPLATE_NAME).read_text(
        encoding="utf-8"
    )


def _plain(value: Any, key: str) -> Any:
    """Report values as plain YAML-safe Python (numpy scalars -> int/float)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "item"):  # 0-d arrays / tensors
        return _plain(value.item(), key)
    raise TypeError(f"privacy report field {key!r} has unsupported type {type(value).__name__}.")


def round_count(count: int | None) -> int | None:
    """A count rounded to 2 significant figures (1101 -> 1100). Coarser, but not DP: still not covered by ε."""
    if count is None:
        return None
    count = int(count)
    return int(round(count, min(0, 2 - len(str(abs(count))))))


def _normalised_report(report: Mapping[str, Any]) -> dict[str, Any]:
    plain = {key: _plain(value, key) for key, value in report.items()}
    ordered = {key: plain[key] for key in REPORT_KEYS if key in plain}
    ordered.update({key: value for key, value in plain.items() if key not in ordered})
    if ordered.get("non_private"):
        return ordered
    if fixed_seed(ordered) and not ordered.get("no_guarantee"):  # a known seed regenerates the noise: no guarantee
        ordered = {"no_guarantee": True, **ordered}
    missing = [key for key in _REQUIRED_KEYS if ordered.get(key) is None]
    if missing:
        raise ValueError(
            f"privacy report is missing {missing}; pass the dict returned by "
            "DPTrainer.privacy_report(), or set non_private=True for a run without DP."
        )
    for key in _NUMERIC_KEYS:
        value = ordered.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise ValueError(f"privacy report field {key}={value!r} must be a number, not "
                             f"{type(value).__name__}; pass the dict returned by DPTrainer.privacy_report().")
    unit, sampling, key = ordered["privacy_unit"], ordered.get("sampling"), ordered["mechanism"]
    if key not in {m.key for m in registered_mechanisms()}:
        raise ValueError(f"privacy report mechanism={key!r}: use one of {tuple(m.key for m in registered_mechanisms())}"
                         " (the keys of hf_dp.vocabulary.MECHANISMS for DP runs).")
    if unit != MECHANISMS[key].privacy_unit:
        raise ValueError(f"privacy report privacy_unit={unit!r} does not go with mechanism={key!r}, whose "
                         f"privacy_unit is {MECHANISMS[key].privacy_unit!r}.")
    expected_sampling = MECHANISMS[key].sampling
    if sampling != expected_sampling:
        raise ValueError(f"privacy report sampling={sampling!r} does not go with mechanism={key!r}: it must be "
                         f"{expected_sampling!r} (None at the example level, where sampling is unused).")
    if get_mechanism(key).requires_contribution_bound and ordered.get("contribution_bound") is None:
        raise ValueError(f"{key.upper()} needs contribution_bound (G) in the report: its accounting depends on it.")
    if ordered.get("adaptive_clipping"):
        missing = [name for name in _ADAPTIVE_KEYS if ordered.get(name) is None]
        if missing:
            raise ValueError(f"privacy report has adaptive_clipping=True but is missing {missing}: the card states "
                             "how C was chosen; pass the dict returned by DPTrainer.privacy_report().")
    return ordered


def fixed_seed(report: Mapping[str, Any]) -> bool:
    """Whether the report's noise came from a fixed, known `noise_seed` (anything but "os-entropy", when stated)."""
    return report.get("noise_seed") not in (None, "os-entropy")


def _covered(report: Mapping[str, Any]) -> list[str]:
    """What the stated (ε, δ) covers: the releases the ledger records."""
    items = [
        "**The weights** of this model and of every training checkpoint: they are computed from the noised "
        "gradient sums only.",
    ]
    adaptive = bool(report.get("adaptive_clipping"))
    if "logging_noise_multiplier" not in report:
        items.append(
            "**The training logs: not reported.** This report does not say whether the logged loss was "
            "noised; treat any logged training loss or clipped fraction as not covered."
        )
    elif report["logging_noise_multiplier"] is None and adaptive:
        items.append(
            "**The training logs**, which hold ε, δ, σ and q (`dp/epsilon`, `dp/delta`, `dp/noise_multiplier`, "
            "`dp/sample_rate`) and, computed from the noised counts of unclipped units only (see the clipping norm "
            "below), `dp/clipped_fraction` and `dp/clipping_norm`: no loss or batch size was logged "
            "(`private_logging=False`)."
        )
    elif report["logging_noise_multiplier"] is None:
        items.append(
            "**The training logs**, which hold only ε, δ, σ and q (`dp/epsilon`, `dp/delta`, "
            "`dp/noise_multiplier`, `dp/sample_rate`): no loss, clipped fraction or batch size was logged "
            "(`private_logging=False`)."
        )
    elif adaptive:
        items.append(
            "**The training logs** (`trainer_state.json`, every `report_to` integration): `loss` is a noised sum "
            "over each step's Poisson sample — every unit's loss clipped to "
            f"[0, {_fmt(report.get('max_loss'), 'g')}] plus Gaussian noise of std σ_log·max_loss, with σ_log = "
            f"{_fmt_sig(report['logging_noise_multiplier'], 4, up=False)} — divided by the expected batch size; "
            "`dp/clipped_fraction` (½ − R/m, R the noised centred count of unclipped units, m the expected batch "
            "size) and `dp/clipping_norm` (the tracked C) are computed from the noised counts of the clipping norm "
            "below. `dp/epsilon`, `dp/delta`, `dp/noise_multiplier` and `dp/sample_rate` are the plan's values. The "
            "sampled batch size is never logged."
        )
    else:
        items.append(
            "**The training logs** (`trainer_state.json`, every `report_to` integration): `loss` and "
            "`dp/clipped_fraction` are noised sums over each step's Poisson sample — every unit's loss "
            f"clipped to [0, {_fmt(report.get('max_loss'), 'g')}] plus Gaussian noise of std "
            "σ_log·max_loss, and the number of clipped units plus noise of std σ_log, with σ_log = "
            f"{_fmt_sig(report['logging_noise_multiplier'], 4, up=False)} — divided by the expected batch "
            "size. The accountant composes them with the gradient as one Gaussian release of noise "
            f"multiplier σ_eff = (σ⁻² + 2·σ_log⁻²)^(-1/2) = "
            f"{_fmt_sig(report.get('effective_noise_multiplier'), 4, up=False)}. `dp/epsilon`, `dp/delta`, "
            "`dp/noise_multiplier` and `dp/sample_rate` are the plan's values. The sampled batch size is "
            "never logged."
        )
    if adaptive:
        logged_loss = report.get("logging_noise_multiplier") is not None
        items.append(
            "**The clipping norm C**, chosen privately by adaptive clipping (Andrew, Thakkar, McMahan and "
            "Ramaswamy 2021): every step released the count of sampled units whose gradient norm was at most C, "
            "centred (minus half the units sampled, so that one unit moves it by ½) plus Gaussian noise of std "
            f"σ_b = {_fmt_sig(report.get('clipping_count_noise'), 4, up=False)}, and C — from "
            f"{_fmt(report.get('max_grad_norm'), '.4g')} at the first step to "
            f"{_fmt(report.get('final_max_grad_norm'), '.4g')} after the last — was computed from those noised counts "
            "only. The accountant composes the counts with the gradient"
            + (" and the logged loss" if logged_loss else "")
            + " as one Gaussian release of noise multiplier σ_eff = (σ⁻² + (2σ_b)⁻²"
            + (" + σ_log⁻²" if logged_loss else "")
            + f")^(-1/2) = {_fmt_sig(report.get('effective_noise_multiplier'), 4, up=False)}."
        )
    bound_epsilon = report.get("contribution_bound_epsilon") or 0
    if bound_epsilon > 0:
        items.append(
            f"**The contribution bound G = {report.get('contribution_bound')}**, chosen from the data with "
            f"ε = {_fmt_up(bound_epsilon, 4)}: an ε-DP median of the rows per user (exponential mechanism on a "
            "public grid), composed with the training ε above."
        )
    items.append(
        "**This card's ε and δ**, computed from the ledger alone (no data), which is saved beside the card "
        f"(`{LEDGER_FILE}`); `hf-dp publish` recomputes ε from it before any upload."
    )
    return items


# The not-covered item beside an audit section on another DP run of the same users: how the two releases compose.
AUDIT_COMPOSITION_ITEM = (
    "**The empirical audit below, with this model.** The audit trains a second model, with DP, on the "
    "same users plus canaries, and reports how well an attacker guessed the canaries. Publishing its "
    "result beside this model releases the outputs of two runs on the same users: together they are "
    "covered by (ε + ε_audit, 2δ), ε_audit being the audit run's proven ε stated in that section, not by "
    "the (ε, δ) above alone."
)


# What DPSFTTrainer's card adds to the not-covered list: hf_dp's own words, which publish recognises (a card's other
# added items are checked for claims like any added line).
SFT_METRICS_ITEM = ("**SFTTrainer's training metrics.** TRL computes token accuracy, entropy and token counts from "
                    "each training batch; they were not logged, since ε would not cover them.")
LIBRARY_ITEMS = (SFT_METRICS_ITEM,)


def _audit_item(audit_section: str | None) -> list[str]:
    """The audit section reports on another DP run on the same users: say how the two releases compose."""
    return [AUDIT_COMPOSITION_ITEM] if audit_section else []


def _not_covered(report: Mapping[str, Any], extra: Iterable[str]) -> list[str]:
    bound = report.get("contribution_bound")
    units = MECHANISMS[report["mechanism"]].sampled_unit
    items = [
        "**The pretraining data.** Only the private fine-tuning data is protected. Whatever "
        "the base model learned or memorised in pretraining is not, and the model may "
        "reproduce it.",
        "**Hyperparameter search on private data.** ε accounts for one training run. "
        + ("Learning rates, σ, C, steps or G picked by comparing several runs on the private "
           if not report.get("adaptive_clipping") else
           "Learning rates, σ, the initial C, the target quantile γ, steps or G picked by comparing several runs "
           "on the private ")
        + "data leak information that ε does not count, unless that choice is itself a DP "
        "release recorded in the ledger"
        + (" (as C is here: adaptive clipping, above)." if report.get("adaptive_clipping") else "."),
        "**Preprocessing decisions.** "
        + (
            "Filters, deduplication and tokenisation are not privatised (G was, see above): if they were "
            if (report.get("contribution_bound_epsilon") or 0) > 0
            else (f"The contribution bound G = {bound}, " if bound is not None else "The contribution bound, ")
            + "filters, deduplication and tokenisation are not privatised: if they were "
        )
        + "chosen by looking at the private data (for example G from the median number of examples "
        "per user), that choice itself reveals something about it.",
        "**Who a user is.** The unit is one value of the user-id column. A person who "
        "appears under several ids is protected only as that many units; ids shared by "
        "several people protect them together, not each.",
        "**The size of the data.** The numbers of users and examples are shown rounded to 2 "
        "significant figures, but rounding is not differentially private. They are not covered by ε, nor "
        f"is what follows from them: q = expected batch size / number of {units} gives that "
        "number exactly, and the steps of a run planned in epochs and a calibrated σ depend on it.",
        "**Evaluation results and the public-only baseline comparison.** The baseline and the "
        "evaluation scores (and the `eval_*` entries of the training logs) are computed outside the "
        "guarantee, on held-out data of other users: they are not releases of the training data, and "
        "the evaluation data get no protection. "
        "They are informative only if that data is not part of the base model's pretraining "
        "data; well-known public text (plays, Wikipedia) may be, which flatters both the "
        "baseline and the DP model.",
    ]
    if not get_mechanism(report["mechanism"]).protects_users:
        items.append(
            "**Users with many rows.** The guarantee is per row: a user's whole contribution "
            "is protected only by group privacy, which is weak when they have many rows."
        )
    seed = str(report.get("noise_seed") or "not reported")
    if seed == "os-entropy":
        items.append(
            "**The noise generator.** The noise seed came from OS entropy and is stored nowhere; the "
            "Gaussian draws came from " + str(report.get("noise_source") or "a generator seeded from it") + ". "
            + _sampler_sentence(report)
            + "The generator's statistical quality, the rounding inside each draw (float64) and in the clipped sums "
            "(the gradients' dtype), "
            "and side channels such as training time are not modelled (docs/guarantee.md, \"Noise in floating "
            "point\")."
        )
    else:
        items.append(
            f"**The noise seed ({seed}).** Noise drawn from a known seed can be regenerated "
            "and subtracted: with a fixed seed this model has no effective privacy "
            "guarantee. Fixed seeds are for tests only; do not release such a model."
        )
    items.extend(extra)
    return items


def _sampler_sentence(report: Mapping[str, Any]) -> str:
    """What the sampler's finite support adds to δ, as the card's not-covered item says it."""
    added = report.get("delta_floating_point")
    if added is None:
        return ("This report does not say what the sampler's finite support adds to δ, so δ assumes ideal Gaussian "
                "sampling. ")
    return (f"Its draws reach {_fmt(report.get('noise_reach'), '.2f')} standard deviations; what lies beyond, "
            f"δ = {_fmt_sig(added, 2, up=True)}, is included in the stated δ. ")


def hub_model_id(name: str | None) -> str | None:
    """`name` when it reads as a Hub repo id (`owner/name`, or a legacy one-part id such as `gpt2`) and is not a local
    path; `None` otherwise. A local folder's path is never published: the card says "a local model" instead."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if not isinstance(name, str) or not name or os.path.exists(os.path.expanduser(name)):
        return None
    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return name


def _tags(privacy: Mapping[str, Any], entry) -> list[str]:
    """The card's Hub tags: none may say "differentially private" of a non-private or fixed-seed run."""
    tags = ["hf_dp"]
    if privacy.get("non_private"):
        tags.append("non-private")
    elif privacy.get("no_guarantee"):  # DP-SGD ran, but with a known seed: no tag may say the model is DP
        tags += ["no-privacy-guarantee", "dp-sgd"]
    else:
        tags += ["differential-privacy", "dp-sgd"]
        tags.append("user-level-dp" if privacy.get("privacy_unit") == "user" else "example-level-dp")
        if entry.sampling is not None:
            tags.append(f"dp-{entry.sampling}")
    return tags


def _eval_results(task: str, dataset_name: str | None, metric_name: str, eval_result) -> list | None:
    """The `model-index` entry of the fine-tuned model's metric, when there is one."""
    if eval_result is None:
        return None
    return [EvalResult(task_type=task, dataset_type=dataset_name or "private-user-data",
                       dataset_name=dataset_name or "private user data", metric_type=metric_name,
                       metric_value=_plain(eval_result, "eval_result"))]


def _privacy_figures(privacy: Mapping[str, Any], entry) -> dict[str, Any]:
    """The template's privacy values, each written as the card states it: ε and δ rounded up, σ down."""
    no_guarantee = bool(privacy.get("no_guarantee"))
    unit_plural = entry.sampled_unit if entry is not None else "examples"
    population_size = privacy.get("num_users" if unit_plural == "users" else "num_examples")
    expected = privacy.get("expected_batch_size")  # public: the argument, not q × a count of the data
    if expected is None and population_size is not None and privacy.get("sample_rate") is not None:
        expected = privacy["sample_rate"] * population_size
    bound = privacy.get("contribution_bound")
    if bound is not None and privacy.get("redraw_rows"):
        contribution_md = (f"all of their rows (a step that samples them trains on at most G = {bound} of them, "
                           "drawn afresh each step)")
    elif bound is not None:
        contribution_md = (f"all of their rows, at most G = {bound} examples (rows beyond G were dropped before "
                           "training)")
    else:
        contribution_md = "all of their rows, however many"
    return dict(
        no_guarantee=no_guarantee,
        privacy_unit=privacy.get("privacy_unit"),
        mechanism=None if entry is None else entry.key,
        sampling=None if entry is None else entry.sampling,
        mechanism_name="" if entry is None else entry.name,
        mechanism_description="" if entry is None else (privacy.get("mechanism_description") or entry.description),
        eps=_fmt_up(privacy.get("epsilon"), 2),
        delta=_fmt_sig(privacy.get("delta"), 3, up=True),
        delta_floating_point=privacy.get("delta_floating_point"),
        delta_accountant_md=_fmt_sig(privacy.get("delta_accountant"), 3, up=True),
        delta_floating_point_md=_fmt_sig(privacy.get("delta_floating_point"), 2, up=True),
        noise_reach_md=_fmt(privacy.get("noise_reach"), ".2f"),
        eps_lower=privacy.get("epsilon_lower"),
        eps_estimate=privacy.get("epsilon_estimate"),
        eps_lower_md=_fmt_down(privacy.get("epsilon_lower"), 3),
        eps_estimate_md=_fmt_up(privacy.get("epsilon_estimate"), 3),
        eps_upper_md=_fmt_up(privacy.get("epsilon"), 3),
        target_epsilon=privacy.get("target_epsilon"),
        target_epsilon_md=_fmt(privacy.get("target_epsilon"), "g"),
        mechanism_step="" if entry is None else get_mechanism(entry.key).card_step,
        mechanism_accounting=None if entry is None else get_mechanism(entry.key).card_accounting(
            _fmt_up(privacy["epsilon_group_privacy"], 2) if privacy.get("epsilon_group_privacy") is not None
            else None),
        noise_multiplier=_fmt_sig(privacy.get("noise_multiplier"), 4, up=False),
        logging_noise_multiplier=privacy.get("logging_noise_multiplier"),
        logging_noise_multiplier_md=_fmt_sig(privacy.get("logging_noise_multiplier"), 4, up=False),
        max_loss_md=_fmt(privacy.get("max_loss"), "g"),
        effective_noise_multiplier=privacy.get("effective_noise_multiplier"),
        effective_noise_multiplier_md=_fmt_sig(privacy.get("effective_noise_multiplier"), 4, up=False),
        sample_rate=_fmt_sig(privacy.get("sample_rate"), 4, up=True),
        expected_batch=_fmt(expected, ".1f") if expected is not None else "not reported",
        unit_plural=unit_plural,
        steps=_fmt(privacy.get("steps"), "d"),
        max_grad_norm=_fmt(privacy.get("max_grad_norm"), ".4g"),
        adaptive=bool(privacy.get("adaptive_clipping")),
        final_max_grad_norm=_fmt(privacy.get("final_max_grad_norm"), ".4g"),
        target_unclipped_quantile=_fmt(privacy.get("target_unclipped_quantile"), "g"),
        clipping_learning_rate=_fmt(privacy.get("clipping_learning_rate"), "g"),
        clipping_count_noise=_fmt_sig(privacy.get("clipping_count_noise"), 4, up=False),
        unit_singular=unit_plural[:-1],
        contribution_bound=_fmt(bound, "d") if bound is not None else "none (all rows kept)",
        contribution_md=contribution_md,
        num_users=_fmt(round_count(privacy.get("num_users")), ","),
        num_examples=_fmt(round_count(privacy.get("num_examples")), ","),
        noise_seed=privacy.get("noise_seed") or "not reported",
        noise_seed_md=(privacy.get("noise_seed") or "not reported")
        + (" — known, not a secret: NO privacy guarantee" if no_guarantee else ""),
        noise_source=privacy.get("noise_source") or "not reported",
        accountant=privacy.get("accountant") or "not reported",
    )


def render_privacy_card(
    report: Mapping[str, Any],
    *,
    base_model: str | None,
    dataset_name: str | None = None,
    task: str = "text-classification",
    metric_name: str = "accuracy",
    eval_result: float | None = None,
    baseline_result: float | None = None,
    non_private_result: float | None = None,
    model_name: str | None = None,
    extra_not_covered: Iterable[str] = (),
    library_name: str = "transformers",
    audit_section: str | None = None,
    base_quantization: str | None = None,
) -> ModelCard:
    """Render the privacy model card of a training run.

    Args:
        report (`Mapping[str, Any]`):
            The dict returned by [`DPTrainer.privacy_report`]: `epsilon`, `delta`,
            `privacy_unit`, `mechanism` (`"uls"`, `"els"` or `"example"`, a key of
            [`~hf_dp.vocabulary.MECHANISMS`]), `sampling` (`"uls"`/`"els"` for user level, `None` for
            example level), `noise_multiplier`, `sample_rate`, `steps`, `max_grad_norm` are required;
            `epsilon_lower`, `epsilon_estimate`, `epsilon_group_privacy` (ELS), `contribution_bound`,
            `num_users`, `num_examples`, `accountant`, `mechanism_description`, `noise_seed` are shown when
            present.
            A report with `non_private: True` gives a card that says there is no guarantee.
            It is copied, field for field, into the front matter's `privacy:` block.
        base_model (`str`, *optional*): Hub id or path of the pretrained model. Only a Hub id ([`hub_model_id`])
            goes into the card (`base_model:` and its first sentence); a local path reads "a local model".
        dataset_name (`str`, *optional*): the fine-tuning data set's name or Hub id.
        task (`str`, *optional*, defaults to `"text-classification"`): Hub pipeline tag.
        metric_name (`str`, *optional*, defaults to `"accuracy"`): the metric of the results.
        eval_result (`float`, *optional*): the fine-tuned model's metric (goes into `model-index`).
        baseline_result (`float`, *optional*): the public-only baseline's metric.
        non_private_result (`float`, *optional*): a non-private fine-tune's metric.
        audit_section (`str`, *optional*): the "Empirical audit" section,
            [`~hf_dp.audit.AuditReport.card_section`], appended as is. It reports on a second DP run on the same
            users, so the card says that model and section together are covered by composition, not by ε alone.
            `hf-dp publish` checks the section against the report beside the card (`dp_audit.json`), which
            [`~hf_dp.audit.AuditReport.write_to_card`] writes with it: prefer that. The four evaluation
            arguments go into the `dp_evaluation:` block under the same names
            ([`~hf_dp.vocabulary.EVAL_KEYS`]).
        model_name (`str`, *optional*): the card's title; defaults to `<base model>-hf-dp`.
        extra_not_covered (`Iterable[str]`, *optional*): more items for the "not covered" list
            of "What the guarantee covers".
        library_name (`str`, *optional*, defaults to `"transformers"`): the Hub library
            that loads the weights (`"peft"` for a LoRA adapter).
        base_quantization (`str`, *optional*): how the frozen base was quantized for training (QLoRA, e.g.
            `"4-bit NF4 (bitsandbytes)"`): the card says so and how to load the adapter onto such a base.

    Returns:
        [`~huggingface_hub.ModelCard`]; `card.save(path)` or [`write_privacy_card`] writes it.

    Raises:
        ValueError: a required report field is missing or not a number, or unit, mechanism and sampling do not
            match.
        TypeError: a report value that cannot go into YAML.

    Example:

    ```python
    >>> card = render_privacy_card(trainer.privacy_report(), base_model="gpt2",
    ...                            eval_result=0.71, baseline_result=0.52)
    >>> card.save("README.md")
    >>> card.data.to_dict()["privacy"]["mechanism"]
    'uls'

    ```
    """
    privacy = _normalised_report(report)
    hub_id = hub_model_id(base_model)
    non_private = bool(privacy.get("non_private"))
    entry = None if non_private else MECHANISMS[privacy["mechanism"]]
    if model_name is None:
        stem = base_model.rstrip("/").split("/")[-1] if base_model else "model"
        model_name = f"{stem}-hf-dp" if not non_private else f"{stem}-non-private"
    figures = dict(zip(EVAL_KEYS, (eval_result, baseline_result, non_private_result, metric_name)))
    comparison = {k: _plain(figures[k], k) for k in ("metric_name", *EVAL_KEYS[:3]) if figures[k] is not None}
    card_data = ModelCardData(
        base_model=hub_id,
        datasets=[dataset_name] if dataset_name else None,
        library_name=library_name,
        pipeline_tag=task,
        tags=_tags(privacy, entry),
        eval_results=_eval_results(task, dataset_name, metric_name, eval_result),
        model_name=model_name,
        privacy=privacy,
        dp_evaluation=comparison if len(comparison) > 1 else None,
    )
    label = "Fine-tuned without DP (this model)" if non_private else "DP fine-tuned (this model)"
    eval_rows = []
    if eval_result is not None:
        eval_rows.append((label, _fmt(eval_result, ".4g")))
    if baseline_result is not None:
        eval_rows.append(("Public-only baseline (pretrained, no private data)", _fmt(baseline_result, ".4g")))
    if non_private_result is not None and not non_private:
        eval_rows.append(("Non-private fine-tuning (no guarantee)", _fmt(non_private_result, ".4g")))

    environment = jinja2.Environment(
        trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined, autoescape=False,
    )
    content = environment.from_string(_template_text()).render(
        card_data=card_data.to_yaml(),
        model_name=model_name,
        non_private=non_private,
        base_model_md=f"`{hub_id}`" if hub_id else "a local model" if base_model else "an unnamed base model",
        dataset_name=dataset_name,
        task=task,
        base_quantization=base_quantization,
        base_id=hub_id or "path/to/the/base-model",
        metric_name=metric_name,
        eval_rows=eval_rows,
        eval_result=eval_result,
        baseline_result=baseline_result,
        covered=[] if non_private else _covered(privacy),
        not_covered=[] if non_private else _not_covered(privacy, [*extra_not_covered, *_audit_item(audit_section)]),
        **_privacy_figures(privacy, entry),
    )
    if audit_section:
        content = content.rstrip("\n") + "\n\n" + audit_section.strip() + "\n"
    return ModelCard(content)


def write_privacy_card(report: Mapping[str, Any], output_dir: str | os.PathLike, *,
                       ledger: Mapping[str, Any] | None = None, **kwargs: Any) -> Path:
    """Render the privacy card (see [`render_privacy_card`]) and save it as `output_dir/README.md`.

    Args:
        ledger (`Mapping`, *optional*): [`DPTrainer.privacy_ledger`] (the accountant's state, δ, unit and
            sampling), saved beside the card as `dp_ledger.json`: `hf-dp publish` recomputes ε from it and
            refuses a card without it. Without a ledger, a stale `dp_ledger.json` there is removed.

    Returns:
        `Path`: the README written.
    """
    path = Path(output_dir) / "README.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    render_privacy_card(report, **kwargs).save(path)
    ledger_path = path.parent / LEDGER_FILE
    if ledger is not None:
        ledger_path.write_text(json.dumps(dict(ledger), indent=2) + "\n", encoding="utf-8")
    elif ledger_path.exists():
        ledger_path.unlink()
    return path
