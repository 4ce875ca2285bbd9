"""The privacy report (what the card, the app and the logs state) and Trainer's model-card fields mapped onto it.

Everything here is post-processing of the plan and the ledger: no effect on ε.
"""

from __future__ import annotations

from . import checkpoint
from .arguments import DPTrainingArguments
from .budget import PrivacyBudget
from .card import round_count
from .contribution import bound_choice
from .hub import ensure_hub_reachable
from .model_kind import is_causal_lm
from .accounting.floating_point import NOISE_REACH
from .accounting.ledger import ACCOUNTANT_NAME
from .card_check import ledger_facts
from .noise import noise_source
from .mechanisms import MECHANISMS


def privacy_report(budget: PrivacyBudget, args: DPTrainingArguments, *, clipping_norm: float, num_users: int,
                   num_examples: int, device_type: str = "cpu") -> dict:
    """The guarantee earned so far, in the project's vocabulary (what the card and the app show).

    `mechanism` is the key of [`~hf_dp.vocabulary.MECHANISMS`] (`"uls"`, `"els"` or `"example"`) and
    `mechanism_description` its one-sentence account; `sampling` is the `sampling` argument at user level and
    `None` at example level (where it is unused). `num_users` and `num_examples` are rounded to 2 significant
    figures: they are not covered by ε.

    `max_grad_norm` is the argument: the clipping norm C, or with `adaptive_clipping` the C₀ it started from;
    `final_max_grad_norm` is adaptive clipping's tracked C after the last step (what a continued run would clip at;
    a post-processing of the noised counts, covered by ε), with `target_unclipped_quantile`,
    `clipping_learning_rate` and `clipping_count_noise` (σ_b) its settings; for a fixed C those four are `None`.

    `delta` is the stated δ: the accountant's (`delta_accountant`, the plan's target) plus what the noise sampler's
    finite support adds (`delta_floating_point`, for draws that reach `noise_reach` standard deviations).

    A run with a fixed `noise_seed` gets `no_guarantee: True` (first) and a `noise_source` that names the seed: anyone
    who knows it regenerates the noise, so the figures are the accountant's for secret noise, not this model's.
    """
    plan, accountant = budget.plan, budget.accountant
    adaptive = plan.adaptive_clipping
    steps = accountant.steps
    lower, estimate, upper = budget.epsilon_bounds()
    bound_epsilon = budget.bound_epsilon
    report = {
        "epsilon": upper,
        "epsilon_lower": lower,
        "epsilon_estimate": estimate,
        "delta": budget.delta(),
        "delta_accountant": plan.delta,
        "delta_floating_point": budget.sampler_delta(),
        "noise_reach": NOISE_REACH,
        "target_epsilon": args.target_epsilon,
        "privacy_unit": args.privacy_unit,
        "mechanism": plan.mechanism,
        "mechanism_description": MECHANISMS[plan.mechanism].description,
        "sampling": plan.dp_mechanism.sampling,
        "noise_multiplier": plan.noise_multiplier,
        "logging_noise_multiplier": plan.logging_noise_multiplier,
        "max_loss": args.max_loss if plan.private_logging else None,
        "effective_noise_multiplier": plan.effective_noise_multiplier,
        "sample_rate": plan.sample_rate,
        "expected_batch_size": args.expected_batch_size,
        "steps": steps,
        "max_grad_norm": args.max_grad_norm,
        "adaptive_clipping": adaptive is not None,
        "final_max_grad_norm": clipping_norm if adaptive else None,
        "target_unclipped_quantile": adaptive.target_quantile if adaptive else None,
        "clipping_learning_rate": adaptive.learning_rate if adaptive else None,
        "clipping_count_noise": plan.count_noise,
        "contribution_bound": plan.contribution_bound,
        # ε-DP choice of G ("auto": a DP median on the public grid; 0 when G was given) and DP-SGD's share of ε.
        "contribution_bound_epsilon": bound_epsilon,
        "contribution_bound_choice": bound_choice(args, plan.mechanism, bound_epsilon),
        "epsilon_training": upper - accountant.pure_dp_epsilon,
        "num_users": round_count(num_users),
        "num_examples": round_count(num_examples),
        "accountant": ACCOUNTANT_NAME + plan.dp_mechanism.accountant_note,
        "epsilon_group_privacy": None,
        "noise_seed": "os-entropy" if args.noise_seed is None else f"fixed seed for testing: {args.noise_seed}",
        "noise_source": _noise_source(args, device_type),
    }
    if args.noise_seed is not None:  # a known key regenerates the noise: the card says so first, and publish refuses
        report = {"no_guarantee": True, **report}
    if args.redraw_rows:  # listed only when set: each step draws G among a user's rows (the card says so)
        report["redraw_rows"] = True
    loose = plan.dp_mechanism.group_privacy_epsilon(
        sample_rate=plan.sample_rate, noise_multiplier=plan.effective_noise_multiplier, steps=steps,
        delta=plan.delta, group_size=plan.group_size) if steps else None
    if loose is not None:
        report["epsilon_group_privacy"] = loose + accountant.pure_dp_epsilon  # the same releases, composed loosely
    return report


def _noise_source(args: DPTrainingArguments, device_type: str) -> str:
    """[`~hf_dp.noise.noise_source`], or with a fixed `noise_seed` what keys the noise instead of a secret."""
    source = noise_source(args.secure_noise, device_type)
    if args.noise_seed is None:
        return source
    fixed = f"the fixed noise_seed={args.noise_seed} (NOT a secret: no privacy guarantee)"
    keyed = source.replace("the run's secret (256 bits from OS entropy)", fixed).replace(
        "the run's secret (OS entropy)", fixed)
    return keyed if keyed != source else f"keyed by {fixed}: {source}"


def base_model_name(model) -> str | None:
    """The name or path the model was loaded from (`None` for one built from a config): the card keeps a Hub id
    and calls a local folder "a local model" ([`~hf_dp.card.hub_model_id`])."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(getattr(base, "config", None), "_name_or_path", None) or None


def card_fields(*, model_name, finetuned_from, tasks, dataset_tags, dataset, dataset_args) -> dict:
    """Trainer's `create_model_card` fields as privacy card arguments (those given).

    Raises:
        ValueError: `dataset_args`, or several tasks or datasets (the card states one of each).
    """
    if dataset_args is not None:
        raise ValueError(f"create_model_card(dataset_args={dataset_args!r}): the privacy card names its dataset "
                         "(dataset_tags or dataset) but no dataset configuration; leave dataset_args unset.")
    fields = {"model_name": model_name, "base_model": finetuned_from, "task": _one("tasks", tasks),
              "dataset_name": _one("dataset_tags", dataset_tags) or _one("dataset", dataset)}
    return {key: value for key, value in fields.items() if value is not None}


def add_card_metadata(path, *, language=None, license=None, tags=None) -> None:
    """Add `language`, `license` and `tags` (after the card's own) to a written card's front matter."""
    if language is None and license is None and not tags:
        return
    from huggingface_hub import ModelCard

    card = ModelCard.load(path)
    if language is not None:
        card.data.language = language
    if license is not None:
        card.data.license = license
    if tags:
        own = list(card.data.tags or [])
        card.data.tags = own + [tag for tag in ([tags] if isinstance(tags, str) else tags) if tag not in own]
    card.save(path)


def _one(name: str, value):
    """A card field Trainer may pass as a list: one value, or a clear refusal."""
    if isinstance(value, (list, tuple)):
        if len(value) > 1:
            raise ValueError(f"create_model_card({name}={list(value)!r}): the privacy card states one; pass one.")
        return value[0] if value else None
    return value


class PrivacyReporting:
    """What a DP trainer publishes: the report, the ledger, the privacy card as Trainer's model card, and the Hub
    upload guarded by a reachability check. Mixed into [`~hf_dp.trainer.DPTrainerMixin`]; needs its `budget`,
    `args`, `partition`, `model` and `privacy_card_kwargs`."""

    def privacy_report(self, state=None) -> dict:
        """The guarantee earned so far, in the project's vocabulary (what the card and the app show); its fields
        are described in [`~hf_dp.report.privacy_report`]. `state`: a [`~hf_dp.step.StepState`] to report instead
        of the live budget and C (a checkpoint's)."""
        canary_users, canary_rows = self.canary_counts
        budget, clipping_norm = (self.budget, self.clipping_norm) if state is None else (state.budget,
                                                                                          state.clipping_norm)
        return privacy_report(budget, self.args, clipping_norm=clipping_norm,
                              num_users=self.partition.num_users - canary_users,
                              num_examples=self.partition.num_examples - canary_rows,
                              device_type=self.args.device.type)

    def privacy_ledger(self, state=None) -> dict:
        """The ledger `hf-dp publish` recomputes ε from: the accountant's state, δ, unit and mechanism
        (`privacy_unit`, `mechanism` and `sampling` as in [`privacy_report`]), and under `report` the privacy
        report's other figures ([`~hf_dp.card_check.ledger_facts`]), which publish checks the card against.
        `state`: as for [`privacy_report`]."""
        # The report's recorded figures too (σ, C, G, users, target ε, seed): publish checks every figure of a card
        # against them, and them against the accountant.
        accountant = self.accountant if state is None else state.budget.accountant
        return {**checkpoint.ledger_record(self.privacy_plan, self.args, accountant),
                "report": ledger_facts(self.privacy_report(state))}

    def write_privacy_card(self, output_dir: str | None = None, **card_kwargs):
        """Write the privacy card to `output_dir/README.md` and the ledger beside it (`dp_ledger.json`, which
        `hf-dp publish` checks the card against). Post-processing: no effect on ε."""
        from .card import write_privacy_card

        task = "text-generation" if is_causal_lm(self.model) else "text-classification"  # the Hub's pipeline tag
        kwargs = {"base_model": base_model_name(self.model), "task": task, **self.privacy_card_kwargs, **card_kwargs}
        return write_privacy_card(self.privacy_report(), output_dir or self.args.output_dir,
                                  ledger=self.privacy_ledger(), **kwargs)

    def create_model_card(self, language: str | None = None, license: str | None = None,
                          tags: str | list[str] | None = None, model_name: str | None = None,
                          finetuned_from: str | None = None, tasks: str | list[str] | None = None,
                          dataset_tags: str | list[str] | None = None, dataset: str | list[str] | None = None,
                          dataset_args: str | list[str] | None = None) -> None:
        """Write the privacy card as `output_dir/README.md` (what `push_to_hub` publishes), with Trainer's fields.

        `model_name` is the card's title, `finetuned_from` its `base_model`, `tasks` its pipeline tag,
        `dataset_tags` (or `dataset`) its dataset; `language`, `license` and `tags` join its metadata (after the
        card's own tags). What `privacy_card_kwargs` sets wins. Post-processing: no effect on ε.

        Raises:
            ValueError: `dataset_args`, or several tasks or datasets (the card states one of each).
        """
        fields = card_fields(model_name=model_name, finetuned_from=finetuned_from, tasks=tasks,
                             dataset_tags=dataset_tags, dataset=dataset, dataset_args=dataset_args)
        if not self.is_world_process_zero():
            return
        path = self.write_privacy_card(**{k: v for k, v in fields.items() if k not in self.privacy_card_kwargs})
        add_card_metadata(path, language=language, license=license, tags=tags)

    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        """Offline or unreachable Hub: one clear `HubUnreachableError` before any repo is created."""
        ensure_hub_reachable()
        super().init_hf_repo(token=token, private=private)

    def push_to_hub(self, *args, **kwargs):
        """Trainer's `push_to_hub` (privacy card as README), after checking the Hub is reachable: nothing is
        uploaded offline (`HF_HUB_OFFLINE=1`) or when the endpoint does not answer (`HubUnreachableError`)."""
        ensure_hub_reachable()
        return super().push_to_hub(*args, **kwargs)
