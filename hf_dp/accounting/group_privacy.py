"""Black-box group privacy: the loose user-level ε that ELS's tight accountant is compared with."""
from __future__ import annotations

import math

import numpy as np

from .checks import Kind, check_delta, check_group_size, check_steps, make_kind
from .composition import discretisation, eps_error_target, epsilon, horizon, rdp_curve
from .privacy_loss import DIRECTIONS
from .renyi import RDP_ORDERS

__all__ = ["group_privacy_epsilon"]

_GROUP_PROFILE_ORDERS = tuple(sorted(set(RDP_ORDERS) | {
    64.0, 80.0, 96.0, 128.0, 160.0, 192.0, 256.0, 384.0, 512.0, 768.0, 1024.0, 1536.0, 2048.0, 4096.0}))


def group_privacy_epsilon(*, sample_rate: float, noise_multiplier: float, steps: int, delta: float,
                          group_size: int) -> float:
    """User-level ε from the example-level guarantee by black-box group privacy (loose; for comparison).

    An (ε', δ')-DP algorithm is (G·ε', G·e^{(G−1)ε'}·δ')-DP for groups of G examples. This returns
    the smallest G·ε' such that the example-level run (G = 1, same q, σ, T) is (ε', δ')-DP with
    G·e^{(G−1)ε'}·δ' ≤ `delta`. The example-level privacy profile δ'(ε') is bounded by
    prv-accountant (where its precision reaches) and by RDP (for the tiny δ' that large G needs),
    whichever is smaller. Cards show it beside the mixture-of-Gaussians ε of ELS, which accounts
    the same users tightly.

    Args: as [`epsilon`], with `group_size` (`int`) the contribution bound G ≥ 1 (a user's rows are the group).

    Returns:
        `float`: the group-privacy ε (∞ when no ε' satisfies the constraint).

    Raises:
        ValueError: an argument is out of range.
    """
    kind = make_kind(sample_rate, noise_multiplier, 1)
    group = check_group_size(group_size)
    steps = check_steps(steps)
    delta = check_delta(delta)
    if steps == 0:
        return 0.0
    if group == 1:
        return epsilon(sample_rate=sample_rate, noise_multiplier=noise_multiplier, steps=steps, delta=delta)
    log_delta_bound = _example_profile(kind, steps, delta / group)

    def feasible(eps_prime: float) -> bool:
        return math.log(group) + (group - 1) * eps_prime + log_delta_bound(eps_prime) <= math.log(delta)

    top = 1.0
    while not feasible(top):
        top *= 2
        if top > 1e6:
            return math.inf
    grid = np.linspace(0.0, top, 2001)[1:]
    first = next(i for i, e in enumerate(grid) if feasible(float(e)))
    lo, hi = (float(grid[first - 1]) if first else 0.0), float(grid[first])
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    return group * hi


def _example_profile(kind: Kind, steps: int, delta_scale: float):
    """log of an upper bound on the example-level δ'(ε') of `steps` steps (worst direction).

    prv-accountant's bound δ_est(ε' − eps_error) + delta_error (the discretisation `epsilon()`
    uses, at δ/G), and the RDP bound for the δ' far below its reach; the smaller.
    """
    orders = np.asarray(_GROUP_PROFILE_ORDERS)
    rdp = {d: rdp_curve((kind,), (steps,), d, orders=_GROUP_PROFILE_ORDERS) for d in DIRECTIONS}
    profiles = []
    steps_horizon = horizon(steps)
    eps_error = eps_error_target((kind,), (steps_horizon,), delta_scale)
    for acc in (discretisation(d, (kind,), (steps_horizon,), delta_scale, eps_error) for d in DIRECTIONS):
        pmf_n = acc.compute_composition([steps])
        t = pmf_n.domain.ts()
        p = np.asarray(pmf_n.pmf, dtype=np.longdouble)
        tail = np.flip(np.cumsum(np.flip(p)))
        tail_weighted = np.flip(np.cumsum(np.flip(p * np.exp(-t))))
        # float slack of the long double sums, as prv-accountant's own precision check
        slack = acc.delta_error + 10 * np.finfo(np.longdouble).eps * len(t)
        profiles.append((t, tail, tail_weighted, slack, acc.eps_error))

    def log_delta(eps_prime: float) -> float:
        worst = -math.inf
        for direction, (t, tail, tail_weighted, slack, eps_error) in zip(DIRECTIONS, profiles):
            with np.errstate(invalid="ignore", over="ignore"):
                log_rdp = (orders - 1) * (rdp[direction] + np.log1p(-1 / orders) - eps_prime) - np.log(orders)
            bound = float(np.nanmin(log_rdp))
            shifted = eps_prime - eps_error  # prv-accountant's upper bound on δ(ε'): δ_est(ε' − err) + err
            i = int(np.searchsorted(t, shifted))
            if i < len(t):
                prv_delta = float(tail[i] - np.exp(np.longdouble(shifted)) * tail_weighted[i]) + slack
            else:
                prv_delta = slack
            bound = min(bound, math.log(min(1.0, prv_delta)))
            worst = max(worst, bound)
        return worst

    return log_delta
