"""Budget planner: noise, ε and contribution bound for ULS, ELS and example-level DP-SGD.

Pure functions with keyword arguments returning plain dicts, for the `hf-dp plan` command and
the Gradio app. The three mechanisms (keys of [`~hf_dp.vocabulary.MECHANISMS`]: `"uls"`, `"els"`,
`"example"`) are compared at the same *compute budget*: the same expected number of examples processed per
step (`examples_per_step`) and the same number of steps, as in Charles et al. 2024 ("Fine-Tuning Large
Language Models with User-Level Differential Privacy", arXiv 2407.07737). Each row gives the
`DPTrainingArguments.expected_batch_size` that spends this budget, in its `sampled_unit`:

- **ULS** (user-level sampling, user-level guarantee): Poisson-sample users; a sampled user
  contributes the clipped mean gradient of its ≤ G examples. With m(G) = mean_u min(n_u, G)
  examples per user, a step processes `examples_per_step` examples from
  `expected_batch_size` = examples_per_step / m(G) users on average, so q = expected_batch_size / users.
  Accounted as the Poisson-subsampled Gaussian.
- **ELS** (example-level sampling, user-level guarantee): keep ≤ G examples per user, Poisson-sample
  `expected_batch_size` = examples_per_step examples, q = examples_per_step / (examples kept); the user-level ε
  comes from the mixture-of-Gaussians accountant with contribution bound G.
- **example-level** DP-SGD: Poisson-sample `expected_batch_size` = examples_per_step examples,
  q = examples_per_step / examples. Its guarantee protects single rows only: a user with many rows is not
  protected as a whole.

Nothing here changes a guarantee by itself: it predicts what a run with these settings spends.

Data-dependent choices are releases too. [`recommend_contribution_bound_els`],
[`recommend_contribution_bound_uls`] and [`plan`] read the counts they are given exactly (the median, the
largest count): give them public or assumed numbers. On private data, [`private_contribution_bound`] (what
`DPTrainer` runs for `contribution_bound="auto"`) chooses G with ε-DP from the public grid
`CONTRIBUTION_BOUND_GRID`, through a DP median ([`private_quantile`], the exponential mechanism); its ε joins
the run's ledger.
"""
from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import numpy as np

from hf_dp import accounting
from hf_dp.accounting.adaptive_noise import (
    effective_noise_multiplier,
    gradient_noise_multiplier,
    resolve_count_noise,
)
from hf_dp.accounting.floating_point import check_sampler_range, sampler_delta
from hf_dp.vocabulary import MECHANISMS

__all__ = [
    "CONTRIBUTION_BOUND_GRID",
    "plan",
    "private_contribution_bound",
    "private_quantile",
    "quantile_probabilities",
    "recommend_contribution_bound_els",
    "recommend_contribution_bound_uls",
]

DEFAULT_TARGET_EPSILON = 8.0
DEFAULT_TRAINABLE_PARAMETERS = 10**11  # values noised per step when the model is not given: an upper bound
# Public candidates for a privately chosen contribution bound G (never a value read from the data).
CONTRIBUTION_BOUND_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def _counts(examples_per_user) -> np.ndarray:
    """Validated examples-per-user counts (users with no examples are dropped)."""
    try:
        counts = np.asarray(list(examples_per_user) if not isinstance(examples_per_user, np.ndarray)
                            else examples_per_user)
    except TypeError as error:
        raise ValueError("examples_per_user must be a list of non-negative integer counts, one per user.") from error
    if counts.ndim != 1 or counts.size == 0:
        raise ValueError("examples_per_user must be a non-empty list of counts, one per user.")
    if not np.issubdtype(counts.dtype, np.number) or np.any(counts != np.round(counts)):
        raise ValueError("examples_per_user must hold whole numbers (examples per user).")
    if np.any(counts < 0):
        raise ValueError(f"examples_per_user has a negative count ({int(counts.min())}): counts must be ≥ 0.")
    counts = counts.astype(np.int64)
    counts = counts[counts > 0]
    if counts.size == 0:
        raise ValueError("every user has 0 examples: there is nothing to train on.")
    return counts


@dataclass(frozen=True)
class _Population:
    """Examples per user as (distinct count, users holding it): its size never grows with the users."""

    values: np.ndarray  # distinct counts, increasing
    users_with: np.ndarray  # users holding each

    @classmethod
    def of(cls, examples_per_user) -> "_Population":
        if isinstance(examples_per_user, _Population):
            return examples_per_user
        values, users_with = np.unique(_counts(examples_per_user), return_counts=True)
        return cls(values, users_with)

    @classmethod
    def uniform(cls, users: int, count: int) -> "_Population":
        return cls(np.array([count], dtype=np.int64), np.array([users], dtype=np.int64))

    @property
    def users(self) -> int:
        return int(self.users_with.sum())

    @property
    def examples(self) -> int:
        return int((self.values * self.users_with).sum())

    @property
    def largest(self) -> int:
        return int(self.values[-1])

    def kept(self, group: int) -> int:
        """Examples left when every user keeps at most `group`."""
        return int((np.minimum(self.values, group) * self.users_with).sum())

    def median(self) -> int:
        """The lower median count (`statistics.median_low`)."""
        return int(self.values[np.searchsorted(np.cumsum(self.users_with), (self.users - 1) // 2, side="right")])


def recommend_contribution_bound_els(examples_per_user) -> int:
    """G for ELS: the median number of examples per user (Charles et al. 2024), at least 1.

    The lower median (an actual count) of the users' example counts.

    Raises:
        ValueError: the counts are empty or negative.

    Example:
        >>> recommend_contribution_bound_els([1, 3, 8, 20])
        3
    """
    return max(1, _Population.of(examples_per_user).median())


def _uls_candidates(population: _Population) -> list[int]:
    top = population.largest
    candidates = {1, top, max(1, population.median())}
    g = 2
    while g < top:
        candidates.add(g)
        g *= 2
    return sorted(candidates)


def recommend_contribution_bound_uls(examples_per_user, *, examples_per_step: float, steps: int | None = None,
                                     target_epsilon: float = DEFAULT_TARGET_EPSILON,
                                     target_delta: float | None = None) -> int:
    """G for ULS by noise prediction under a fixed compute budget (after Charles et al. 2024).

    For each candidate G (1, powers of two, the median and the largest count), predict the noise
    of the averaged update relative to its signal and return the G that minimises it:

        m(G)     = mean_u min(n_u, G)                examples a sampled user contributes
        M(G)     = examples_per_step / m(G)          expected users per step (fixed compute): ULS's
                                                     expected_batch_size
        q(G)     = M(G) / users                      user sampling rate (must be ≤ 1)
        σ(G)     = rdp_noise_multiplier(target_epsilon, δ, q(G), steps)  (RDP: cheap, ranks the G alike)
        noise(G) = σ(G) / (M(G) · √m(G))  =  σ(G) · √m(G) / examples_per_step

    σ(G)/M(G) is the standard deviation of the privacy noise in the averaged update, in units of
    the clipping norm C. The factor 1/√m(G) is the signal: in the regime DP fine-tuning runs in
    (a small C that clips every user's gradient, Li et al. 2021) each user contributes the
    direction of its mean gradient, and when per-example gradient noise dominates, the component
    of that direction along the true gradient grows like √m with the m examples averaged. More
    examples per user thus buy signal, fewer users per step cost noise, and the privacy cost
    decides the balance through σ(q). (Without the √m factor the prediction always favours G = 1,
    which discards all but one example per user.) Ties go to the larger G.

    Args:
        examples_per_user (`Sequence[int]`): examples of each user (zeros are ignored).
        examples_per_step (`float`): the compute budget, expected examples processed per step.
        steps (`int`, *optional*): T; defaults to one expected pass over the examples,
            ⌈examples / examples_per_step⌉.
        target_epsilon (`float`, *optional*, defaults to `8.0`): ε the run must meet.
        target_delta (`float`, *optional*): δ; defaults to 1/(10·users).

    Returns:
        `int`: the recommended contribution bound G ≥ 1.

    Raises:
        ValueError: bad counts or budget, or no candidate G can meet the target.

    Example:
        >>> recommend_contribution_bound_uls([2, 5, 9, 40] * 250, examples_per_step=256, steps=200)
        4
    """
    population = _Population.of(examples_per_user)
    users = population.users
    budget = _positive(examples_per_step, "examples_per_step")
    target_epsilon = _positive(target_epsilon, "target_epsilon")
    steps = _default_steps(steps, population, budget)
    delta = _user_delta(target_delta, users)
    best, best_noise, problems = None, math.inf, []
    for group in _uls_candidates(population):
        per_user = population.kept(group) / users
        users_per_step = budget / per_user
        sample_rate = users_per_step / users
        if sample_rate > 1:
            problems.append(f"G={group}: needs {users_per_step:.4g} users per step of {users}")
            continue
        try:  # RDP's σ ranks the candidates in milliseconds (the exact σ of the choice is the caller's)
            sigma = accounting.rdp_noise_multiplier(target_epsilon=target_epsilon, delta=delta,
                                                    sample_rate=sample_rate, steps=steps)
        except ValueError as error:
            problems.append(f"G={group}: {error}")
            continue
        noise = sigma / (users_per_step * math.sqrt(per_user))
        if noise <= best_noise * (1 + 1e-9):
            best, best_noise = group, noise
    if best is None:
        raise ValueError("No contribution bound G fits this budget for ULS (" + "; ".join(problems[:2]) + ").")
    return best


def quantile_probabilities(examples_per_user, *, epsilon: float, quantile: float = 0.5,
                           grid=CONTRIBUTION_BOUND_GRID) -> np.ndarray:
    """Probabilities with which [`private_quantile`] releases each value of the public `grid`.

    The exponential mechanism (McSherry & Talwar 2007) for a quantile of the examples per user. Each user's
    count is rounded up to the grid (counts above its top to the top), and a grid value g has utility

        u(g) = −distance(quantile · users, [#users below g, #users at g or below])

    (0 when g is the quantile). Adding or removing one user moves every u(g) by at most 1, so releasing g with
    probability ∝ exp(ε·u(g)/2) is ε-DP: between neighbouring datasets every probability changes by a factor
    of at most e^ε.

    Args:
        examples_per_user (`Sequence[int]`): examples of each user (zeros are ignored).
        epsilon (`float`): ε of the release (affects accounting: record it in the ledger).
        quantile (`float`, *optional*, defaults to `0.5`): which quantile, in [0, 1].
        grid (`Sequence[int]`, *optional*, defaults to `CONTRIBUTION_BOUND_GRID`): the public candidates,
            increasing positive integers.

    Returns:
        `np.ndarray`: the probability of each grid value.

    Raises:
        ValueError: bad counts, ε, quantile or grid.

    Example:
        >>> p = quantile_probabilities([3] * 1000, epsilon=0.1)
        >>> CONTRIBUTION_BOUND_GRID[p.argmax()], bool(p.max() > 0.99)
        (3, True)
    """
    counts = np.sort(_counts(examples_per_user))
    epsilon = _positive(epsilon, "epsilon")
    if isinstance(quantile, bool) or not isinstance(quantile, (int, float, np.number)) or not 0 <= quantile <= 1:
        raise ValueError(f"quantile={quantile!r} must be in [0, 1].")
    grid = np.asarray(grid)
    if grid.ndim != 1 or grid.size == 0 or not np.issubdtype(grid.dtype, np.integer) or grid[0] < 1 \
            or np.any(np.diff(grid) <= 0):
        raise ValueError("grid must be a non-empty increasing sequence of positive integers.")
    at_most = np.searchsorted(counts, grid, side="right")
    at_most[-1] = counts.size  # the top of the grid stands for every larger count
    below = np.concatenate(([0], at_most[:-1]))
    rank = quantile * counts.size
    distance = np.maximum(0.0, np.maximum(below - rank, rank - at_most))
    logits = -epsilon * distance / 2
    weights = np.exp(logits - logits.max())
    return weights / weights.sum()


def private_quantile(examples_per_user, *, epsilon: float, rng: np.random.Generator | None = None,
                     quantile: float = 0.5, grid=CONTRIBUTION_BOUND_GRID) -> int:
    """An ε-DP `quantile` of the examples per user: one grid value drawn from [`quantile_probabilities`].

    Affects accounting: the release costs `epsilon` (pure ε-DP), whatever value it returns.

    Args:
        examples_per_user, epsilon, quantile, grid: as in [`quantile_probabilities`].
        rng (`numpy.random.Generator`, *optional*): the draw's randomness; default: fresh OS entropy.

    Returns:
        `int`: a value of `grid`.

    Example:
        >>> private_quantile([2, 3, 3, 5] * 500, epsilon=0.5)
        3
    """
    probabilities = quantile_probabilities(examples_per_user, epsilon=epsilon, quantile=quantile, grid=grid)
    rng = np.random.default_rng() if rng is None else rng
    return int(np.asarray(grid)[rng.choice(len(probabilities), p=probabilities)])


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
        sampling (`str`): `"uls"` or `"els"`.
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
    from hf_dp.mechanisms import get_mechanism

    mechanism = get_mechanism(sampling)
    if not mechanism.protects_users:
        raise ValueError(f"sampling={sampling!r}: use 'uls' or 'els' (example-level DP-SGD keeps every row).")
    return mechanism.choose_contribution_bound(_counts(examples_per_user), epsilon=epsilon,
                                               expected_batch_size=expected_batch_size, steps=steps,
                                               target_epsilon=target_epsilon, delta=delta, rng=rng)


def uls_bound_from_median(users: int, median: int, *, expected_batch_size: int, steps: int, target_epsilon: float,
                          delta=None) -> int:
    """ULS's G for `users` users of `median` rows each (a public or DP number): the noise-prediction heuristic for
    this compute budget, or the median itself when the heuristic has no answer."""
    if expected_batch_size > users:
        return median
    try:
        return recommend_contribution_bound_uls(_Population.uniform(users, median),
                                                examples_per_step=expected_batch_size * median, steps=steps,
                                                target_epsilon=target_epsilon, target_delta=delta)
    except ValueError:
        return median


def _positive(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not (
            value > 0 and math.isfinite(value)):
        raise ValueError(f"{name}={value!r} must be a positive number.")
    return float(value)


def _default_steps(steps, population: _Population, budget: float) -> int:
    if steps is None:
        return max(1, math.ceil(population.examples / budget))
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"steps={steps!r} must be an integer ≥ 1.")
    return int(steps)


def _user_delta(delta, users: int) -> float:
    if delta is None:
        return 1.0 / (10 * users)
    if isinstance(delta, bool) or not isinstance(delta, (int, float, np.number)) or not 0 < delta < 1:
        raise ValueError(f"target_delta={delta!r} must be in (0, 1); the default is 1/(10·users).")
    if delta >= 1.0 / users:
        raise ValueError(f"target_delta={delta:g} is not below 1/users = 1/{users}: such a δ allows releasing a "
                         f"whole user's data; lower target_delta (default 1/(10·users) = {1 / (10 * users):.3g}).")
    return float(delta)


def _population(users, examples_per_user) -> _Population:
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
        population = _Population.uniform(int(users), int(examples_per_user))
    else:
        population = _Population.of(examples_per_user)
        if users is not None and users != population.users:
            raise ValueError(f"users={users} but examples_per_user lists {population.users} users with examples: "
                             "give one of them, or make them agree.")
    if population.users < 2:
        raise ValueError(f"users={population.users}: DPTrainer refuses training data with a single user (a "
                         "user-level guarantee needs many users: with one, the model is that user's data); plan "
                         "with the number of users you will train on, at least 2 (in practice hundreds or more).")
    return population


def plan(*, users: int | None = None, examples_per_user=None, examples_per_step: float = 64,
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
        `list[dict]`: one row per mechanism (`"uls"`, `"els"`, `"example"`) with keys `mechanism` (a key of
        [`~hf_dp.vocabulary.MECHANISMS`]), `label` (its label there), `privacy_unit`, `contribution_bound`,
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
        >>> rows = plan(users=1000, examples_per_user=20, examples_per_step=64, steps=300, target_epsilon=4.0)
        >>> [(row["mechanism"], round(row["expected_batch_size"], 1), row["sampled_unit"]) for row in rows]
        [('uls', 32.0, 'users'), ('els', 64.0, 'examples'), ('example', 64.0, 'examples')]
    """
    population = _population(users, examples_per_user)
    users = population.users
    examples = population.examples
    budget = _positive(examples_per_step, "examples_per_step")
    if isinstance(target_epsilon, bool) or not isinstance(target_epsilon, (int, float, np.number)) or not (
            target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"target_epsilon={target_epsilon!r} must be a positive number (e.g. 8).")
    target = float(target_epsilon)
    user_delta = _user_delta(target_delta, users)
    example_delta = user_delta if target_delta is not None else 1.0 / (10 * examples)
    if budget > examples:
        raise ValueError(f"examples_per_step={budget:g} exceeds the {examples} examples (sample rate > 1): "
                         "lower examples_per_step.")
    steps = _default_steps(steps, population, budget)
    sigma_fixed = None if noise_multiplier is None else _positive(noise_multiplier, "noise_multiplier")
    if contribution_bound is not None and (isinstance(contribution_bound, bool)
                                           or not isinstance(contribution_bound, (int, np.integer))
                                           or contribution_bound < 1):
        raise ValueError(f"contribution_bound={contribution_bound!r} must be an integer ≥ 1.")
    adaptive = _adaptive(adaptive_clipping, clipping_count_noise)

    rows = []
    # ULS
    group = contribution_bound
    note = ""
    if group is None:
        try:
            group = recommend_contribution_bound_uls(population, examples_per_step=budget, steps=steps,
                                                     target_epsilon=target, target_delta=user_delta)
        except ValueError as error:
            group, note = recommend_contribution_bound_els(population), str(error)
    per_user = population.kept(group) / users
    rows.append(_row("uls", group, budget / per_user, users, budget, steps, user_delta, target, sigma_fixed, 1,
                     population.kept(group), note, adaptive=adaptive))
    # ELS
    group = contribution_bound or recommend_contribution_bound_els(population)
    kept = population.kept(group)
    rows.append(_row("els", group, budget, kept, budget, steps, user_delta, target, sigma_fixed, group, kept, "",
                     adaptive=adaptive))
    # example-level
    note = "protects single rows only: a user with many rows is not protected as a whole"
    if example_delta >= 1.0 / examples:
        rows.append(_row("example", None, budget, examples, budget, steps, example_delta, target, None, 1, examples,
                         f"target_delta={example_delta:g} is not below 1/examples; {note}", skip=True,
                         adaptive=adaptive))
    else:
        rows.append(_row("example", None, budget, examples, budget, steps, example_delta, target, sigma_fixed, 1,
                         examples, note, adaptive=adaptive))
    accounted = [row for row in rows if not row["skip"]]
    if sigma_fixed is not None and accounted and all(row["unbounded"] for row in accounted):
        raise ValueError(f"noise_multiplier={sigma_fixed:g}: so little noise that no mechanism's ε can be accounted "
                         "(it is beyond the accountant's range, effectively unbounded); raise --noise_multiplier "
                         "(σ around 0.5-2 is typical) or leave it unset to get the σ each mechanism needs.")
    draws = steps * (_positive(trainable_parameters, "trainable_parameters") + 2)  # + the logged loss and count
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
        _positive(clipping_count_noise, "clipping_count_noise")
        if not adaptive_clipping:
            raise ValueError(f"clipping_count_noise={clipping_count_noise:g} is only used with adaptive clipping: "
                             "add --adaptive_clipping, or drop --clipping_count_noise.")
    if not adaptive_clipping:
        return None
    return functools.partial(resolve_count_noise, clipping_count_noise)


def _row(key, group, expected_batch_size, population, examples_per_step, steps, delta, target, sigma_fixed,
         accounting_group, examples_used, note, skip=False, adaptive=None) -> dict:
    entry = MECHANISMS[key]
    sample_rate = expected_batch_size / population
    row = {
        "mechanism": key,
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
        "skip": skip,  # not accounted (removed before `plan` returns)
        "unbounded": False,  # ε at the fixed σ beyond the accountant's range (removed before `plan` returns)
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
