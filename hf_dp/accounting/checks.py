"""Argument checks of the accounting API: one message per problem, saying what to change."""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

# The accountant's tested domain. Beyond it the numerics are not checked against references:
# refuse with one line rather than answer slowly or wrongly.
MAX_STEPS = 10_000_000
MAX_GROUP_SIZE = 256
MIN_DELTA = 1e-15


class Kind(NamedTuple):
    """The parameters of one step: (q, σ, G)."""

    sample_rate: float
    noise_multiplier: float
    group_size: int


def _is_number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float, np.number))


def check_sample_rate(sample_rate) -> float:
    if not _is_number(sample_rate) or not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate={sample_rate!r} must be in (0, 1]: it is the probability that one "
                         "unit is in a batch (expected batch size / number of units).")
    return float(sample_rate)


def check_noise_multiplier(noise_multiplier) -> float:
    if not _is_number(noise_multiplier) or not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"noise_multiplier={noise_multiplier!r} must be a positive number "
                         "(noise std = noise_multiplier · max_grad_norm).")
    return float(noise_multiplier)


def check_count(value, name: str, minimum: int, maximum: int | None = None) -> int:
    integral = isinstance(value, (int, np.integer)) or isinstance(value, (float, np.floating)) and float(
        value).is_integer()
    if isinstance(value, bool) or not integral or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer ≥ {minimum}.")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}={value!r} is above {maximum:,}, the most the accountant is tested for: "
                         f"lower {name}.")
    return int(value)


def check_steps(steps, minimum: int = 0) -> int:
    return check_count(steps, "steps", minimum, MAX_STEPS)


def check_group_size(group_size) -> int:
    return check_count(group_size, "group_size", 1, MAX_GROUP_SIZE)


def check_delta(delta) -> float:
    if not _is_number(delta) or not 0 < delta < 1:
        raise ValueError(f"delta={delta!r} must be in (0, 1); a common choice is 1/(10 · number of users).")
    if delta < MIN_DELTA:
        raise ValueError(f"delta={delta!r} is below {MIN_DELTA:g}, beyond the accountant's numerical precision: "
                         "use a larger delta.")
    return float(delta)


def check_target_epsilon(target_epsilon) -> float:
    if not _is_number(target_epsilon) or not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"target_epsilon={target_epsilon!r} must be a positive finite number (e.g. 8).")
    return float(target_epsilon)


def make_kind(sample_rate, noise_multiplier, group_size) -> Kind:
    return Kind(check_sample_rate(sample_rate), check_noise_multiplier(noise_multiplier),
                check_group_size(group_size))
