"""Rows per user, as numbers: their validation, the public grid of G, its ε-DP quantile and the recommended G.

What a contribution bound G is chosen from. [`recommend_contribution_bound_els`] and
[`recommend_contribution_bound_uls`] read the counts they are given exactly (the median, the largest count): give
them public or assumed numbers. On private data, [`private_quantile`] (the exponential mechanism over the public
grid `CONTRIBUTION_BOUND_GRID`) releases an ε-DP quantile, a release the run's ledger records; the mechanisms
([`~hf_dp.mechanisms`]) turn it into G for `contribution_bound="auto"`.

Pure: numpy and the accountant's RDP calibration, no torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import accounting

__all__ = [
    "CONTRIBUTION_BOUND_GRID",
    "DEFAULT_TARGET_EPSILON",
    "UserCounts",
    "counts_per_user",
    "default_steps",
    "positive_number",
    "private_quantile",
    "quantile_probabilities",
    "recommend_contribution_bound_els",
    "recommend_contribution_bound_uls",
    "uls_bound_from_median",
    "user_delta",
]

DEFAULT_TARGET_EPSILON = 8.0
# Public candidates for a privately chosen contribution bound G (never a value read from the data).
CONTRIBUTION_BOUND_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def counts_per_user(examples_per_user) -> np.ndarray:
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
class UserCounts:
    """Examples per user as (distinct count, users holding it): its size never grows with the users."""

    values: np.ndarray  # distinct counts, increasing
    users_with: np.ndarray  # users holding each

    @classmethod
    def of(cls, examples_per_user) -> "UserCounts":
        if isinstance(examples_per_user, UserCounts):
            return examples_per_user
        values, users_with = np.unique(counts_per_user(examples_per_user), return_counts=True)
        return cls(values, users_with)

    @classmethod
    def uniform(cls, users: int, count: int) -> "UserCounts":
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
    return max(1, UserCounts.of(examples_per_user).median())


def _uls_candidates(population: UserCounts) -> list[int]:
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
    population = UserCounts.of(examples_per_user)
    users = population.users
    budget = positive_number(examples_per_step, "examples_per_step")
    target_epsilon = positive_number(target_epsilon, "target_epsilon")
    steps = default_steps(steps, population, budget)
    delta = user_delta(target_delta, users)
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
    counts = np.sort(counts_per_user(examples_per_user))
    epsilon = positive_number(epsilon, "epsilon")
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


def uls_bound_from_median(users: int, median: int, *, expected_batch_size: int, steps: int, target_epsilon: float,
                          delta=None) -> int:
    """ULS's G for `users` users of `median` rows each (a public or DP number): the noise-prediction heuristic for
    this compute budget, or the median itself when the heuristic has no answer."""
    if expected_batch_size > users:
        return median
    try:
        return recommend_contribution_bound_uls(UserCounts.uniform(users, median),
                                                examples_per_step=expected_batch_size * median, steps=steps,
                                                target_epsilon=target_epsilon, target_delta=delta)
    except ValueError:
        return median


def positive_number(value, name: str) -> float:
    """`value` as a float when it is a finite number > 0, else a ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not (
            value > 0 and math.isfinite(value)):
        raise ValueError(f"{name}={value!r} must be a positive number.")
    return float(value)


def default_steps(steps, population: UserCounts, budget: float) -> int:
    """T as given (an integer ≥ 1), or one expected pass over the examples at `budget` examples per step."""
    if steps is None:
        return max(1, math.ceil(population.examples / budget))
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"steps={steps!r} must be an integer ≥ 1.")
    return int(steps)


def user_delta(delta, users: int) -> float:
    """δ of a user-level guarantee: as given (below 1/users), or the default 1/(10·users)."""
    if delta is None:
        return 1.0 / (10 * users)
    if isinstance(delta, bool) or not isinstance(delta, (int, float, np.number)) or not 0 < delta < 1:
        raise ValueError(f"target_delta={delta!r} must be in (0, 1); the default is 1/(10·users).")
    if delta >= 1.0 / users:
        raise ValueError(f"target_delta={delta:g} is not below 1/users = 1/{users}: such a δ allows releasing a "
                         f"whole user's data; lower target_delta (default 1/(10·users) = {1 / (10 * users):.3g}).")
    return float(delta)


