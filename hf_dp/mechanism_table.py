"""Mechanism table: noise, ε and contribution bound of every registered mechanism, at one compute budget.

Pure functions with keyword arguments returning plain dicts, for the `hf-dp plan` command and the Gradio app. Each
registered mechanism ([`~hf_dp.mechanisms.registered_mechanisms`]: ULS, ELS and example-level DP-SGD, then any a
user registers) gives one row; they are compared at the same *compute budget*: the same expected number of examples
processed per step (`examples_per_step`) and the same number of steps, as in Charles et al. 2024 ("Fine-Tuning
Large Language Models with User-Level Differential Privacy", arXiv 2407.07737). Each row gives the
`DPTrainingArguments.expected_batch_size` that spends this budget, in its `sampled_unit`:

- a mechanism that samples users (**ULS**): a sampled user contributes the clipped mean gradient of its ≤ G
  examples. With m(G) = mean_u min(n_u, G) examples per user, a step processes `examples_per_step` examples from
  `expected_batch_size` = examples_per_step / m(G) users on average, so q = expected_batch_size / users.
- a mechanism that samples rows (**ELS**, **example-level**): keep ≤ G examples per user (every row without G),
  Poisson-sample `expected_batch_size` = examples_per_step examples, q = examples_per_step / (examples kept).

The mechanism says which G it plans with ([`~hf_dp.mechanisms.DPMechanism.planned_bound`]: ULS's noise
prediction, ELS's median, none at the example level), which δ applies (1/(10·users) or 1/(10·examples)), and what
the accountant composes (its group size: G for ELS's mixture of Gaussians, 1 otherwise). Example-level DP-SGD
protects single rows only: a user with many rows is not protected as a whole.

Nothing here changes a guarantee by itself: it predicts what a run with these settings spends. [`compare`] reads the
counts it is given exactly (the median, the largest count): give it public or assumed numbers. On private data,
[`private_contribution_bound`] (what `DPTrainer` runs for `contribution_bound="auto"`) chooses G with ε-DP from the
public grid `CONTRIBUTION_BOUND_GRID`, through a DP median ([`~hf_dp.user_counts.private_quantile`], the
exponential mechanism); its ε joins the run's ledger.
"""
from __future__ import annotations

import functools
import math
import warnings

import numpy as np

from hf_dp import accounting
from hf_dp.accounting.adaptive_noise import (
    effective_noise_multiplier,
    gradient_noise_multiplier,
    resolve_count_noise,
)
from hf_dp.accounting.floating_point import check_sampler_range, sampler_delta
from hf_dp.mechanisms import DPMechanism, get_mechanism, registered_mechanisms
from hf_dp.user_counts import (  # noqa: F401  (the planner's public names of hf_dp 0.1)
    CONTRIBUTION_BOUND_GRID,
    DEFAULT_TARGET_EPSILON,
    UserCounts,
    counts_per_user,
    default_steps,
    positive_number,
    private_quantile,
    quantile_probabilities,
    recommend_contribution_bound_els,
    recommend_contribution_bound_uls,
    user_delta,
)

__all__ = [
    "CONTRIBUTION_BOUND_GRID",
    "compare",
    "private_contribution_bound",
    "private_quantile",
    "quantile_probabilities",
    "recommend_contribution_bound_els",
    "recommend_contribution_bound_uls",
]

DEFAULT_TRAINABLE_PARAMETERS = 10**11  # values noised per step when the model is not given: an upper bound


def private_contribution_bound(examples_per_user, *, sampling: str, epsilon: float, expected_batch_size: int,
                               steps: int, target_epsilon: float, delta: float | None = None,
                               rng: np.random.Generator | None = None) -> int:
    """G chosen with ε-DP, from the public grid: what `DPTrainer` runs for `contribution_bound="auto"`.

    ELS: an ε-DP median of the examples per user ([`private_quantile`]). ULS: the noise-prediction heuristic
    of [`recommend_contribution_bound_uls`] run on that DP median alone (every user assumed to hold it, a
    compute budget of `expected_batch_size` users × the median examples per step), so its candidates are
    grid values: 1, the powers of two below the median, and the median. Beyond the DP median it reads only
    the number of users (public, as in the sample rate). When no candidate fits the budget it returns the
    median (the trainer's plan then says what to change). Affects accounting: costs `epsilon`.

    Args:
        examples_per_user (`Sequence[int]`): examples of each user.
        sampling (`str`): the key of a mechanism that protects users (`"uls"`, `"els"`).
        epsilon (`float`): ε of the DP median (recorded in the run's ledger).
        expected_batch_size (`int`): users per step (ULS).
        steps (`int`): planned steps (ULS heuristic).
        target_epsilon (`float`): ε left for DP-SGD (ULS heuristic).
        delta (`float`, *optional*): δ (the run's `target_delta`); defaults to 1/(10·users).
        rng (`numpy.random.Generator`, *optional*): the draw's randomness; default: fresh OS entropy.

    Returns:
        `int`: G, a value of `CONTRIBUTION_BOUND_GRID`.

    Example:
        >>> private_contribution_bound([1, 4, 4, 9] * 500, sampling="els", epsilon=0.5, expected_batch_size=64,
        ...                            steps=100, target_epsilon=8.0)
        4
    """
    mechanism = get_mechanism(sampling)
    if not mechanism.protects_users:
        user_level = tuple(m.key for m in registered_mechanisms() if m.protects_users)
        raise ValueError(f"sampling={sampling!r}: use one of {user_level} ({mechanism.name} keeps every row).")
    return mechanism.choose_contribution_bound(counts_per_user(examples_per_user), epsilon=epsilon,
                                               expected_batch_size=expected_batch_size, steps=steps,
                                               target_epsilon=target_epsilon, delta=delta, rng=rng)


def _population(users, examples_per_user) -> UserCounts:
    """Counts per user from either (users, examples per user) or a list of counts; at least 2 users."""
    if examples_per_user is None:
        raise ValueError("give examples_per_user: one count for all users (with users), or a count per user.")
    if isinstance(examples_per_user, (int, np.integer)) and not isinstance(examples_per_user, bool):
        if users is None:
            raise ValueError("give users (the number of users) with a single examples_per_user count.")
        if isinstance(users, bool) or not isinstance(users, (int, np.integer)) or users < 1:
            raise ValueError(f"users={users!r} must be an integer ≥ 2.")
        if examples_per_user < 1:
            raise ValueError(f"examples_per_user={examples_per_user}: must be ≥ 1.")
        population = UserCounts.uniform(int(users), int(examples_per_user))
    else:
        population = UserCounts.of(examples_per_user)
        if users is not None and users != population.users:
            raise ValueError(f"users={users} but examples_per_user lists {population.users} users with examples: "
                             "give one of them, or make them agree.")
    if population.users < 2:
        raise ValueError(f"users={population.users}: DPTrainer refuses training data with a single user (a "
                         "user-level guarantee needs many users: with one, the model is that user's data); plan "
                         "with the number of users you will train on, at least 2 (in practice hundreds or more).")
    return population


def compare(*, users: int | None = None, examples_per_user=None, examples_per_step: float = 64,
         steps: int | None = None, target_epsilon: float = DEFAULT_TARGET_EPSILON, target_delta: float | None = None,
         noise_multiplier: float | None = None, contribution_bound: int | None = None,
         adaptive_clipping: bool = False, clipping_count_noise: float | None = None,
         trainable_parameters: int = DEFAULT_TRAINABLE_PARAMETERS) -> list[dict]:
    """Plan a DP fine-tuning run: σ needed for (ε, δ), ε at a fixed σ, G, q, batch and steps per mechanism.

    Args:
        users (`int`, *optional*): number of users (at least 2); needed when `examples_per_user` is one number.
        examples_per_user (`int` or `Sequence[int]`): examples of every user, or one count per user: public
            or assumed numbers, read exactly (the default G's are their median and a heuristic over them). For
            private data plan on a DP statistic instead, as `hf-dp plan --data` does ([`private_quantile`]).
        examples_per_step (`float`, *optional*, defaults to `64`): the compute budget, expected examples
            processed per step, the same for every mechanism (each row turns it into its `expected_batch_size`).
        steps (`int`, *optional*): T; defaults to one expected pass over the examples.
        target_epsilon (`float`, *optional*, defaults to `8.0`): ε to meet.
        target_delta (`float`, *optional*): δ; defaults to 1/(10·users) for the user-level rows and
            1/(10·examples) for the example-level row (the defaults of `DPTrainingArguments`). Must be below
            1/users.
        noise_multiplier (`float`, *optional*): a fixed σ at which to report each mechanism's ε.
        contribution_bound (`int`, *optional*): G for ULS and ELS (`DPTrainingArguments.contribution_bound`).
            Default: the median count for ELS, the noise-prediction heuristic of
            [`recommend_contribution_bound_uls`] for ULS. Example-level DP-SGD keeps every row.
        adaptive_clipping (`bool`, *optional*, defaults to `False`): plan for `DPTrainingArguments.adaptive_clipping`
            (Andrew et al. 2021, [`~hf_dp.clipping.adaptive`]). Each step then also releases a count with noise σ_b,
            and the accountant composes σ_eff = (σ⁻² + (2σ_b)⁻²)^(-1/2): `noise_multiplier` becomes the gradient σ
            DPTrainer calibrates for the target
            ([`~hf_dp.accounting.adaptive_noise.gradient_noise_multiplier`] of the σ_eff the accountant needs;
            larger than the fixed-norm σ), and `epsilon_at_fixed_noise` is accounted at the
            σ_eff of the fixed gradient σ. Like the fixed-norm rows, it leaves out private logging's loss release.
        clipping_count_noise (`float`, *optional*): σ_b, the count's noise std in units
            (`DPTrainingArguments.clipping_count_noise`); defaults to each row's `expected_batch_size` / 20, as in
            DPTrainer. Only with `adaptive_clipping`.
        trainable_parameters (`int`, *optional*): the values noised each step, for what the noise sampler's
            finite support adds to δ (`sampler_delta`, [`~hf_dp.accounting.floating_point.sampler_delta`]);
            defaults to 10¹¹, more than any model fine-tuned today.

    Returns:
        `list[dict]`: one row per registered mechanism (`"uls"`, `"els"`, `"example"`, then any registered
        later) with keys `mechanism` (its key), `label` (its label), `privacy_unit`, `contribution_bound`,
        `sample_rate`, `expected_batch_size` (the `DPTrainingArguments` value spending the budget) and
        `sampled_unit` (what it counts: `"users"` for ULS, `"examples"` otherwise), `examples_per_step`,
        `steps`, `delta`, `target_epsilon`, `noise_multiplier` (σ for the target, None when unreachable),
        `noise_std` (σ / expected_batch_size: the noise in the averaged update, in units of C),
        `effective_noise_multiplier` (the σ_eff the accountant composes: σ itself for a fixed C),
        `count_noise` (adaptive clipping's σ_b, None without it), `fixed_noise_multiplier`,
        `epsilon_at_fixed_noise`, `examples_used`, `sampler_delta` (δ the noise's finite support adds at the
        target ε, which the trainer adds to `delta`) and `note` (why a value is missing, or a caveat).

    Raises:
        ValueError: a one-line message saying what to change (ε ≤ 0, δ ≥ 1/users, fewer than 2 users, a sample
            rate above 1, negative counts, a fixed σ so small that no mechanism's ε can be accounted, a target ε
            beyond the noise sampler's range at the rows' smallest δ ([`~hf_dp.accounting.floating_point`]), ...).

    Example:
        >>> rows = compare(users=1000, examples_per_user=20, examples_per_step=64, steps=300, target_epsilon=4.0)
        >>> [(row["mechanism"], round(row["expected_batch_size"], 1), row["sampled_unit"]) for row in rows]
        [('uls', 32.0, 'users'), ('els', 64.0, 'examples'), ('example', 64.0, 'examples')]
    """
    population = _population(users, examples_per_user)
    users = population.users
    examples = population.examples
    budget = positive_number(examples_per_step, "examples_per_step")
    if isinstance(target_epsilon, bool) or not isinstance(target_epsilon, (int, float, np.number)) or not (
            target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"target_epsilon={target_epsilon!r} must be a positive number (e.g. 8).")
    target = float(target_epsilon)
    users_delta = user_delta(target_delta, users)
    example_delta = users_delta if target_delta is not None else 1.0 / (10 * examples)
    if budget > examples:
        raise ValueError(f"examples_per_step={budget:g} exceeds the {examples} examples (sample rate > 1): "
                         "lower examples_per_step.")
    steps = default_steps(steps, population, budget)
    sigma_fixed = None if noise_multiplier is None else positive_number(noise_multiplier, "noise_multiplier")
    if contribution_bound is not None and (isinstance(contribution_bound, bool)
                                           or not isinstance(contribution_bound, (int, np.integer))
                                           or contribution_bound < 1):
        raise ValueError(f"contribution_bound={contribution_bound!r} must be an integer ≥ 1.")
    adaptive = _adaptive(adaptive_clipping, clipping_count_noise)

    rows = []
    for mechanism in registered_mechanisms():
        delta = users_delta if mechanism.protects_users else example_delta
        group, note = mechanism.planned_bound(population, contribution_bound, examples_per_step=budget, steps=steps,
                                              target_epsilon=target, delta=delta)
        note = "; ".join(part for part in (note, mechanism.plan_note) if part)
        kept = examples if group is None else population.kept(group)
        if mechanism.samples_users:  # m(G) = kept / users examples per sampled user
            expected_batch_size, units = budget / (kept / users), users
        else:
            expected_batch_size, units = budget, kept
        protected, unit = (users, "users") if mechanism.protects_users else (examples, "examples")
        if delta >= 1.0 / protected:
            rows.append(_row(mechanism, group, expected_batch_size, units, budget, steps, delta, target, None, kept,
                             f"target_delta={delta:g} is not below 1/{unit}; {note}", skip=True, adaptive=adaptive))
        else:
            rows.append(_row(mechanism, group, expected_batch_size, units, budget, steps, delta, target, sigma_fixed,
                             kept, note, adaptive=adaptive))
    accounted = [row for row in rows if not row["skip"]]
    if sigma_fixed is not None and accounted and all(row["unbounded"] for row in accounted):
        raise ValueError(f"noise_multiplier={sigma_fixed:g}: so little noise that no mechanism's ε can be accounted "
                         "(it is beyond the accountant's range, effectively unbounded); raise --noise_multiplier "
                         "(σ around 0.5-2 is typical) or leave it unset to get the σ each mechanism needs.")
    draws = steps * (positive_number(trainable_parameters, "trainable_parameters") + 2)  # + the logged loss and count
    check_sampler_range(epsilon=target, delta=min(r["delta"] for r in rows), draws=draws, what="target_epsilon")
    for row in rows:
        del row["skip"], row["unbounded"]
        row["sampler_delta"] = sampler_delta(epsilon=target, delta=row["delta"], draws=draws)
    return rows


def _adaptive(adaptive_clipping, clipping_count_noise):
    """Adaptive clipping's count noise σ_b as a function of the expected batch size m (`clipping_count_noise`,
    or the default m/20 as in DPTrainer), or None without adaptive clipping."""
    if not isinstance(adaptive_clipping, (bool, np.bool_)):
        raise ValueError(f"adaptive_clipping={adaptive_clipping!r}: use True or False.")
    if clipping_count_noise is not None:
        positive_number(clipping_count_noise, "clipping_count_noise")
        if not adaptive_clipping:
            raise ValueError(f"clipping_count_noise={clipping_count_noise:g} is only used with adaptive clipping: "
                             "add --adaptive_clipping, or drop --clipping_count_noise.")
    if not adaptive_clipping:
        return None
    return functools.partial(resolve_count_noise, clipping_count_noise)


def _row(mechanism: DPMechanism, group, expected_batch_size, population, examples_per_step, steps, delta, target,
         sigma_fixed, examples_used, note, skip=False, adaptive=None) -> dict:
    """One mechanism's row: its q for this budget, and σ (or ε at a fixed σ) for the group size it accounts."""
    entry = mechanism.presentation
    accounting_group = mechanism.group_size(group)
    sample_rate = expected_batch_size / population
    row = {
        "mechanism": mechanism.key,
        "label": entry.label,
        "privacy_unit": entry.privacy_unit,
        "contribution_bound": None if group is None else int(group),
        "sample_rate": sample_rate,
        "expected_batch_size": expected_batch_size,
        "sampled_unit": entry.sampled_unit,
        "examples_per_step": examples_per_step,
        "steps": steps,
        "delta": delta,
        "target_epsilon": target,
        "noise_multiplier": None,
        "noise_std": None,
        "effective_noise_multiplier": None,
        "count_noise": None if adaptive is None else adaptive(expected_batch_size),
        "fixed_noise_multiplier": sigma_fixed,
        "epsilon_at_fixed_noise": None,
        "examples_used": examples_used,
        "note": note,
        "skip": skip,  # not accounted (removed before `compare` returns)
        "unbounded": False,  # ε at the fixed σ beyond the accountant's range (removed before `compare` returns)
    }
    if skip:
        return row
    if sample_rate > 1:
        row["note"] = (f"needs expected_batch_size={expected_batch_size:.4g} {entry.sampled_unit} per step of "
                       f"{population}: lower examples_per_step" + (f"; {note}" if note else ""))
        row["skip"] = True
        return row
    problems = []
    count_noise = row["count_noise"]
    try:
        effective = accounting.noise_multiplier(target_epsilon=target, delta=delta, sample_rate=sample_rate,
                                                steps=steps, group_size=accounting_group)
        row["effective_noise_multiplier"] = effective
        # With adaptive clipping the accountant's σ_eff also covers the count: the gradient gets DPTrainer's σ.
        sigma = effective if adaptive is None else gradient_noise_multiplier(effective, count_noise)
        row["noise_multiplier"] = sigma
        row["noise_std"] = sigma / expected_batch_size
    except (ValueError, accounting.AccountingError) as error:
        if row["effective_noise_multiplier"] is None:
            problems.append(str(error))
        else:  # adaptive clipping with σ_b ≤ σ_eff/2: no gradient σ exists
            problems.append(f"clipping_count_noise σ_b={count_noise:.3g} is not above σ_eff/2 = {effective / 2:.3g}: "
                            "adaptive clipping's count alone would spend the budget; raise clipping_count_noise, "
                            "examples_per_step or target_epsilon")
    if sigma_fixed is not None:
        try:
            with warnings.catch_warnings(), np.errstate(all="ignore"):  # prv-accountant overflows on its way out
                warnings.simplefilter("ignore", RuntimeWarning)
                row["epsilon_at_fixed_noise"] = accounting.epsilon(
                    sample_rate=sample_rate, steps=steps, delta=delta, group_size=accounting_group,
                    noise_multiplier=sigma_fixed if adaptive is None
                    else effective_noise_multiplier(sigma_fixed, count_noise))
        except (ValueError, accounting.AccountingError) as error:
            problems.append(f"ε at σ={sigma_fixed:g}: {error}")
            row["unbounded"] = "too large to account" in str(error)
        except RuntimeError:  # prv-accountant's "Cannot compute epsilon": the loss leaves its range
            problems.append(f"ε at σ={sigma_fixed:g}: beyond the accountant's range (effectively unbounded); raise "
                            "noise_multiplier")
            row["unbounded"] = True
    if adaptive is not None and row["noise_multiplier"] is not None:
        problems.append(f"adaptive clipping: gradient σ with count noise σ_b = {count_noise:.3g} for the accounted "
                        f"σ_eff = {row['effective_noise_multiplier']:.4g}")
    row["note"] = "; ".join(p for p in (*problems, note) if p)
    return row
