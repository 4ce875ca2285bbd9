"""Budget planner: noise, ε and contribution bound for ULS, ELS and example-level DP-SGD.

Pure functions with keyword arguments returning plain dicts, for the `hf-dp plan` command and
the Gradio app. The three modes are compared at the same *compute budget*: the same expected
number of examples processed per step (`units_per_step`) and the same number of steps, as in
Charles et al. 2024 ("Fine-Tuning Large Language Models with User-Level Differential Privacy",
arXiv 2407.07737):

- **ULS** (user-level sampling, user-level guarantee): Poisson-sample users; a sampled user
  contributes the clipped mean gradient of its ≤ G examples. With m(G) = mean_u min(n_u, G)
  examples per user, a step processes `units_per_step` examples from M = units_per_step / m(G)
  users on average, so q = M / users. Accounted as the Poisson-subsampled Gaussian.
- **ELS** (example-level sampling, user-level guarantee): keep ≤ G examples per user,
  Poisson-sample examples at q = units_per_step / (examples kept); the user-level ε comes from
  the mixture-of-Gaussians accountant with contribution bound G.
- **example-level** DP-SGD: Poisson-sample examples at q = units_per_step / examples. Its
  guarantee protects single rows only: a user with many rows is not protected as a whole.

Nothing here changes a guarantee by itself: it predicts what a run with these settings spends.
"""
from __future__ import annotations

import math
import statistics

import numpy as np

from . import accounting

__all__ = ["plan", "recommend_contribution_bound_els", "recommend_contribution_bound_uls"]

DEFAULT_TARGET_EPSILON = 8.0
MODE_LABELS = {"uls": "ULS", "els": "ELS (MoG)", "example": "example-level"}


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


def recommend_contribution_bound_els(examples_per_user) -> int:
    """G for ELS: the median number of examples per user (Charles et al. 2024), at least 1.

    The lower median (an actual count) of the users' example counts.

    Raises:
        ValueError: the counts are empty or negative.

    Example:
        >>> recommend_contribution_bound_els([1, 3, 8, 20])
        3
    """
    return max(1, int(statistics.median_low(_counts(examples_per_user).tolist())))


def _uls_candidates(counts: np.ndarray) -> list[int]:
    top = int(counts.max())
    candidates = {1, top, recommend_contribution_bound_els(counts)}
    g = 2
    while g < top:
        candidates.add(g)
        g *= 2
    return sorted(candidates)


def recommend_contribution_bound_uls(examples_per_user, *, units_per_step: float, steps: int | None = None,
                                     target_epsilon: float = DEFAULT_TARGET_EPSILON,
                                     delta: float | None = None) -> int:
    """G for ULS by noise prediction under a fixed compute budget (after Charles et al. 2024).

    For each candidate G (1, powers of two, the median and the largest count), predict the noise
    of the averaged update relative to its signal and return the G that minimises it:

        m(G)     = mean_u min(n_u, G)                examples a sampled user contributes
        M(G)     = units_per_step / m(G)             expected users per step (fixed compute)
        q(G)     = M(G) / users                      user sampling rate (must be ≤ 1)
        σ(G)     = noise_multiplier(target_epsilon, δ, q(G), steps)  (ULS: Poisson-subsampled Gaussian)
        noise(G) = σ(G) / (M(G) · √m(G))  =  σ(G) · √m(G) / units_per_step

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
        units_per_step (`float`): the compute budget, expected examples processed per step.
        steps (`int`, *optional*): T; defaults to one expected pass over the examples,
            ⌈examples / units_per_step⌉.
        target_epsilon (`float`, *optional*, defaults to `8.0`): ε the run must meet.
        delta (`float`, *optional*): δ; defaults to 1/(10·users).

    Returns:
        `int`: the recommended contribution bound G ≥ 1.

    Raises:
        ValueError: bad counts or budget, or no candidate G can meet the target.

    Example:
        >>> recommend_contribution_bound_uls([2, 5, 9, 40] * 250, units_per_step=256, steps=200)
        4
    """
    counts = _counts(examples_per_user)
    users = counts.size
    budget = _positive(units_per_step, "units_per_step")
    target_epsilon = _positive(target_epsilon, "target_epsilon")
    steps = _default_steps(steps, counts, budget)
    delta = _user_delta(delta, users)
    best, best_noise, problems = None, math.inf, []
    for group in _uls_candidates(counts):
        per_user = float(np.minimum(counts, group).mean())
        users_per_step = budget / per_user
        sample_rate = users_per_step / users
        if sample_rate > 1:
            problems.append(f"G={group}: needs {users_per_step:.4g} users per step of {users}")
            continue
        try:
            sigma = accounting.noise_multiplier(target_epsilon=target_epsilon, delta=delta, sample_rate=sample_rate,
                                                steps=steps)
        except ValueError as error:
            problems.append(f"G={group}: {error}")
            continue
        noise = sigma / (users_per_step * math.sqrt(per_user))
        if noise <= best_noise * (1 + 1e-9):
            best, best_noise = group, noise
    if best is None:
        raise ValueError("No contribution bound G fits this budget for ULS (" + "; ".join(problems[:2]) + ").")
    return best


def _positive(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not (
            value > 0 and math.isfinite(value)):
        raise ValueError(f"{name}={value!r} must be a positive number.")
    return float(value)


def _default_steps(steps, counts: np.ndarray, budget: float) -> int:
    if steps is None:
        return max(1, math.ceil(int(counts.sum()) / budget))
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"steps={steps!r} must be an integer ≥ 1.")
    return int(steps)


def _user_delta(delta, users: int) -> float:
    if delta is None:
        return 1.0 / (10 * users)
    if isinstance(delta, bool) or not isinstance(delta, (int, float, np.number)) or not 0 < delta < 1:
        raise ValueError(f"delta={delta!r} must be in (0, 1); the default is 1/(10·users).")
    if delta >= 1.0 / users:
        raise ValueError(f"delta={delta:g} is not below 1/users = 1/{users}: such a δ allows releasing a whole "
                         f"user's data; lower delta (default 1/(10·users) = {1 / (10 * users):.3g}).")
    return float(delta)


def _population(users, examples_per_user) -> np.ndarray:
    """Counts per user from either (users, examples per user) or a list of counts."""
    if examples_per_user is None:
        raise ValueError("give examples_per_user: one count for all users (with users), or a count per user.")
    if isinstance(examples_per_user, (int, np.integer)) and not isinstance(examples_per_user, bool):
        if users is None:
            raise ValueError("give users (the number of users) with a single examples_per_user count.")
        if isinstance(users, bool) or not isinstance(users, (int, np.integer)) or users < 1:
            raise ValueError(f"users={users!r} must be an integer ≥ 1.")
        if examples_per_user < 1:
            raise ValueError(f"examples_per_user={examples_per_user}: must be ≥ 1.")
        return np.full(int(users), int(examples_per_user), dtype=np.int64)
    counts = _counts(examples_per_user)
    if users is not None and users != counts.size:
        raise ValueError(f"users={users} but examples_per_user lists {counts.size} users with examples: "
                         "give one of them, or make them agree.")
    return counts


def plan(*, users: int | None = None, examples_per_user=None, units_per_step: float = 64,
         steps: int | None = None, target_epsilon: float = DEFAULT_TARGET_EPSILON, delta: float | None = None,
         noise_multiplier: float | None = None, contribution_bound_els: int | None = None,
         contribution_bound_uls: int | None = None) -> list[dict]:
    """Plan a DP fine-tuning run: σ needed for (ε, δ), ε at a fixed σ, G, q and steps per mode.

    Args:
        users (`int`, *optional*): number of users; needed when `examples_per_user` is one number.
        examples_per_user (`int` or `Sequence[int]`): examples of every user, or one count per user.
        units_per_step (`float`, *optional*, defaults to `64`): the compute budget, expected examples
            processed per step, the same for every mode (ULS turns it into users per step).
        steps (`int`, *optional*): T; defaults to one expected pass over the examples.
        target_epsilon (`float`, *optional*, defaults to `8.0`): ε to meet.
        delta (`float`, *optional*): δ; defaults to 1/(10·users) for the user-level rows and
            1/(10·examples) for the example-level row. Must be below 1/users.
        noise_multiplier (`float`, *optional*): a fixed σ at which to report each mode's ε.
        contribution_bound_els (`int`, *optional*): G for ELS (default: the median count).
        contribution_bound_uls (`int`, *optional*): G for ULS (default: the noise-prediction
            heuristic of [`recommend_contribution_bound_uls`]).

    Returns:
        `list[dict]`: one row per mode (`"uls"`, `"els"`, `"example"`) with keys `mode`, `label`,
        `privacy_unit`, `contribution_bound`, `sample_rate`, `units_per_step` (users for ULS,
        examples otherwise), `examples_per_step`, `steps`, `delta`, `target_epsilon`,
        `noise_multiplier` (σ for the target, None when unreachable), `noise_std` (σ / units
        per step: the noise in the averaged update, in units of C), `fixed_noise_multiplier`,
        `epsilon_at_fixed_noise`, `examples_used` and `note` (why a value is missing, or a caveat).

    Raises:
        ValueError: a one-line message saying what to change (ε ≤ 0, δ ≥ 1/users, a sample rate
            above 1, negative counts, ...).

    Example:
        >>> rows = plan(users=1000, examples_per_user=20, units_per_step=64, steps=300, target_epsilon=4.0)
        >>> [row["mode"] for row in rows]
        ['uls', 'els', 'example']
    """
    counts = _population(users, examples_per_user)
    users = int(counts.size)
    examples = int(counts.sum())
    budget = _positive(units_per_step, "units_per_step")
    if isinstance(target_epsilon, bool) or not isinstance(target_epsilon, (int, float, np.number)) or not (
            target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"target_epsilon={target_epsilon!r} must be a positive number (e.g. 8).")
    target = float(target_epsilon)
    user_delta = _user_delta(delta, users)
    example_delta = user_delta if delta is not None else 1.0 / (10 * examples)
    if budget > examples:
        raise ValueError(f"units_per_step={budget:g} exceeds the {examples} examples (sample rate > 1): "
                         "lower units_per_step.")
    steps = _default_steps(steps, counts, budget)
    sigma_fixed = None if noise_multiplier is None else _positive(noise_multiplier, "noise_multiplier")
    for name, value in (("contribution_bound_els", contribution_bound_els),
                        ("contribution_bound_uls", contribution_bound_uls)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
            raise ValueError(f"{name}={value!r} must be an integer ≥ 1.")

    rows = []
    # ULS
    group = contribution_bound_uls
    note = ""
    if group is None:
        try:
            group = recommend_contribution_bound_uls(counts, units_per_step=budget, steps=steps,
                                                     target_epsilon=target, delta=user_delta)
        except ValueError as error:
            group, note = recommend_contribution_bound_els(counts), str(error)
    per_user = float(np.minimum(counts, group).mean())
    rows.append(_row("uls", "user", group, budget / per_user, users, budget, steps, user_delta, target,
                     sigma_fixed, 1, int(np.minimum(counts, group).sum()), note))
    # ELS
    group = contribution_bound_els or recommend_contribution_bound_els(counts)
    kept = int(np.minimum(counts, group).sum())
    rows.append(_row("els", "user", group, budget, kept, budget, steps, user_delta, target, sigma_fixed, group,
                     kept, ""))
    # example-level
    note = "protects single rows only: a user with many rows is not protected as a whole"
    if example_delta >= 1.0 / examples:
        rows.append(_row("example", "example", None, budget, examples, budget, steps, example_delta, target, None,
                         1, examples, f"delta={example_delta:g} is not below 1/examples; {note}", skip=True))
    else:
        rows.append(_row("example", "example", None, budget, examples, budget, steps, example_delta, target,
                         sigma_fixed, 1, examples, note))
    return rows


def _row(mode, unit, group, units_per_step, population, examples_per_step, steps, delta, target, sigma_fixed,
         accounting_group, examples_used, note, skip=False) -> dict:
    sample_rate = units_per_step / population
    row = {
        "mode": mode,
        "label": MODE_LABELS[mode],
        "privacy_unit": unit,
        "contribution_bound": None if group is None else int(group),
        "sample_rate": sample_rate,
        "units_per_step": units_per_step,
        "examples_per_step": examples_per_step,
        "steps": steps,
        "delta": delta,
        "target_epsilon": target,
        "noise_multiplier": None,
        "noise_std": None,
        "fixed_noise_multiplier": sigma_fixed,
        "epsilon_at_fixed_noise": None,
        "examples_used": examples_used,
        "note": note,
    }
    if skip:
        return row
    if sample_rate > 1:
        row["note"] = (f"needs {units_per_step:.4g} {unit}s per step of {population}: lower units_per_step"
                       + (f"; {note}" if note else ""))
        return row
    problems = []
    try:
        sigma = accounting.noise_multiplier(target_epsilon=target, delta=delta, sample_rate=sample_rate, steps=steps,
                                            group_size=accounting_group)
        row["noise_multiplier"] = sigma
        row["noise_std"] = sigma / units_per_step
    except ValueError as error:
        problems.append(str(error))
    if sigma_fixed is not None:
        try:
            row["epsilon_at_fixed_noise"] = accounting.epsilon(
                sample_rate=sample_rate, noise_multiplier=sigma_fixed, steps=steps, delta=delta,
                group_size=accounting_group)
        except (ValueError, RuntimeError) as error:
            problems.append(f"ε at σ={sigma_fixed:g}: {error}")
    row["note"] = "; ".join(p for p in (*problems, note) if p)
    return row
