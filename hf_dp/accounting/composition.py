"""ε of DP-SGD runs: compose each step's privacy random variable with prv-accountant.

Every step's privacy random variable is a [`~hf_dp.accounting.privacy_loss.MixtureOfGaussiansPRV`]
(the Poisson-subsampled Gaussian when G = 1); runs are composed once per adjacency direction
(remove and add) and the larger ε is reported. The ε reported is prv-accountant's *upper* bound
(estimate + its certified error), so it is never understated; `epsilon_bounds` also gives the
certified lower bound and the estimate.

Notation: σ = ``noise_multiplier``, q = ``sample_rate``, T = ``steps``,
G = ``group_size`` (``contribution_bound``), C = ``max_grad_norm`` (ε does not depend on C).

Precision and speed (prv-accountant's parameters, chosen here):

- ``eps_error`` (the width of the ε bound above the estimate) is ``EPS_ERROR_RELATIVE`` = 0.4 %
  of the run's ε, estimated first on a coarse discretisation (floored at ``EPS_ERROR_MIN`` =
  1e-3). prv-accountant's mesh, and so the cost, is proportional to √T / ``eps_error``; it is
  capped (`discretisation.MAX_MESH_POINTS`), which widens ``eps_error`` for very long runs.
- ``delta_error`` = ``DELTA_ERROR_RELATIVE`` · δ = δ/1000 (shifts ε by a negligible amount).
- the discretisation is built for a *horizon* ≥ the number of steps, on the ladder ⌈2^(j/4)⌉,
  and reused for every step count up to it. So ε(T) is a deterministic function of
  (q, σ, G, T, δ): `epsilon()` before training, the ledger during training and `epsilon_after`
  give the same number for the same steps, and one more step costs one multiplication in
  Fourier space and one inverse FFT.

Raises `ValueError` with a message that says what to change for out-of-range arguments, and
`AccountingError` when an internal check fails (never a silent number).
"""
from __future__ import annotations

import math

import numpy as np

from .cache import CACHE
from .checks import Kind, check_delta, check_group_size, check_steps, make_kind
from .discretisation import Discretisation, truncated_chernoff_half_width
from .privacy_loss import DIRECTIONS, MixtureOfGaussiansPRV
from .renyi import RDP_ORDERS

__all__ = ["describe_accounting", "epsilon", "epsilon_bounds"]

EPS_ERROR_RELATIVE = 0.004
EPS_ERROR_MIN = 1e-3
DELTA_ERROR_RELATIVE = 1e-3
_HORIZON_STEPS_PER_DOUBLING = 4


def describe_accounting(group_size: int = 1) -> str:
    """One line naming what the accountant composes for a contribution bound G ([`PrivacyAccountant.description`])."""
    group_size = check_group_size(group_size)
    if group_size == 1:
        return "Poisson-subsampled Gaussian (DP-SGD), add/remove adjacency"
    return (f"mixture of Gaussians: Poisson-sampled examples, at most G={group_size} per user, "
            "sensitivity ~ Binomial(G, q) (ELS user-level DP-SGD), add/remove adjacency")


def horizon(steps: int) -> int:
    """Smallest ⌈2^(j/4)⌉ ≥ steps: the discretisation of a run is built for this many steps."""
    if steps <= 1:
        return 1
    j = max(0, math.floor(_HORIZON_STEPS_PER_DOUBLING * math.log2(steps)) - 2)
    while math.ceil(2 ** (j / _HORIZON_STEPS_PER_DOUBLING)) < steps:
        j += 1
    return math.ceil(2 ** (j / _HORIZON_STEPS_PER_DOUBLING))


def privacy_random_variable(kind: Kind, direction: str) -> MixtureOfGaussiansPRV:
    """The step's privacy loss random variable in one adjacency direction (memoised: it keeps its RDP values)."""
    return CACHE.prvs.get_or_build(
        (kind, direction),
        lambda: MixtureOfGaussiansPRV(kind.sample_rate, kind.noise_multiplier, kind.group_size, direction))


def rdp_curve(kinds, counts, direction: str, orders=RDP_ORDERS) -> np.ndarray:
    """Σ_i T_i · D_α for each order α (the RDP of the composition in one direction)."""
    total = np.zeros(len(orders))
    for kind, count in zip(kinds, counts):
        prv = privacy_random_variable(kind, direction)
        total += count * np.array([prv.rdp(a) for a in orders])
    return total


def rdp_epsilon(kinds, counts, delta: float) -> float:
    """The RDP ε (prv-accountant's conversion) of the composition, larger direction: an upper bound."""
    orders = np.asarray(RDP_ORDERS)
    worst = 0.0
    for direction in DIRECTIONS:
        rdp = rdp_curve(kinds, counts, direction)
        with np.errstate(invalid="ignore"):
            eps = rdp - np.log(delta * orders) / (orders - 1) + np.log1p(-1 / orders)
        worst = max(worst, float(np.nanmin(eps)))
    return worst


def epsilon_scale(kinds, counts, delta: float) -> float:
    """A cheap upper bound on ε (the smaller of the RDP ε and a Chernoff bound on the capped
    loss, `truncated_chernoff_half_width`): it sizes the coarse discretisation's error."""
    rdp = rdp_epsilon(kinds, counts, delta)
    prvs = {d: [privacy_random_variable(kind, d) for kind in kinds] for d in DIRECTIONS}
    tail = max(truncated_chernoff_half_width(prvs[d], counts, 0.0, delta) - 3 for d in DIRECTIONS)
    return max(0.0, min(rdp, tail))


def _build(direction: str, kinds, horizons, delta: float, eps_error: float) -> Discretisation:
    return Discretisation([privacy_random_variable(kind, direction) for kind in kinds], horizons, eps_error,
                          DELTA_ERROR_RELATIVE * delta)


def coarse_discretisations(kinds, horizons, delta: float) -> tuple[Discretisation, ...]:
    """A coarse discretisation per direction, its stated error 3 % of `epsilon_scale`: ~8x cheaper than
    the final one. Its *estimate* is much more accurate than its stated error (~0.3 %): it sets
    the final `eps_error` and guides the noise calibration."""
    def build():
        coarse_error = max(EPS_ERROR_MIN, 0.03 * epsilon_scale(kinds, horizons, delta))
        return tuple(_build(d, kinds, horizons, delta, coarse_error) for d in DIRECTIONS)

    return CACHE.coarse.get_or_build((kinds, horizons, delta), build)


def eps_error_target(kinds, horizons, delta: float) -> float:
    """`EPS_ERROR_RELATIVE` of the ε at the horizon (a coarse estimate), at least `EPS_ERROR_MIN`."""
    def compute():
        scale = max(direction_bounds(d, horizons, delta)[1] for d in coarse_discretisations(kinds, horizons, delta))
        return max(EPS_ERROR_MIN, EPS_ERROR_RELATIVE * scale)

    return CACHE.eps_errors.get_or_build((kinds, horizons, delta), compute)


def discretisation(direction: str, kinds, horizons, delta: float, eps_error: float) -> Discretisation:
    key = (direction, kinds, horizons, delta, eps_error)
    return CACHE.discretisations.get_or_build(key, lambda: _build(direction, kinds, horizons, delta, eps_error))


def epsilon_from_pmf(pmf_n, delta: float, delta_error: float, eps_error: float):
    """prv-accountant's `DiscretePrivacyRandomVariable.compute_epsilon`, faster.

    The same formula — δ(t) = Σ_{s≥t} p_s (1 − e^{t−s}) on the grid, ε where it crosses δ ∓
    delta_error, ± eps_error — on the part of the domain where ε ≥ −1 can lie, in float64.
    The suffix sums of non-negative terms carry a relative error below n·2⁻⁵³ ≈ 5e-10 (n ≤ 4e6
    terms), i.e. an absolute error ~1e-10·P[Y > ε] in δ, orders of magnitude below
    delta_error = δ/1000 since P[Y > ε] is a small multiple of δ. Returns None when ε may lie
    further left (the caller falls back to prv-accountant's own routine).
    """
    if pmf_n.log_pmc_inf != 0.0:
        return None
    domain = pmf_n.domain
    first = max(0, int(math.floor((-1.0 - domain.t_min()) / domain.dt())))
    t = np.arange(first, len(domain)) * domain.dt() + domain.t_min()
    if len(t) == 0 or t[-1] > 700:  # the whole loss lies below -1, or exp would overflow: library routine
        return None
    p = np.asarray(pmf_n.pmf[first:], dtype=float)
    tail = np.cumsum(p[::-1])[::-1]
    tail_weighted = np.cumsum((p * np.exp(-t))[::-1])[::-1]
    neg_delta = np.exp(t) * tail_weighted - tail

    def find(target: float):
        i = int(np.searchsorted(neg_delta, -target, side="left"))
        if i <= 0:
            return None
        return math.log((tail[i] - target) / tail_weighted[i])

    upper, estimate, lower = (find(delta - delta_error), find(delta), find(delta + delta_error))
    if upper is None or estimate is None or lower is None:
        return None
    return lower - eps_error, estimate, upper + eps_error


def direction_bounds(acc: Discretisation, counts, delta: float) -> tuple[float, float, float]:
    while True:
        bounds = _bounds(acc, counts, delta)
        if bounds[0] <= 0.0 or acc.check_round_off(bounds[3], bounds[0]):
            return bounds[:3]


def _bounds(acc: Discretisation, counts, delta: float):
    """(lower, estimate, upper, composition) in one direction."""
    try:
        pmf_n = acc.compute_composition(list(counts))
        bounds = epsilon_from_pmf(pmf_n, delta, acc.delta_error, acc.eps_error)  # fast path
        if bounds is None:
            with np.errstate(all="ignore"):  # non-finite results are reported below
                bounds = pmf_n.compute_epsilon(delta, acc.delta_error, acc.eps_error)
        lower, estimate, upper = bounds
    except ValueError as error:  # "Floating point errors will dominate for such small values of delta"
        raise ValueError(f"delta={delta:g} is too small for the accountant's numerical precision at these "
                         "settings: use a larger delta (e.g. 1e-10 or above).") from error
    except RuntimeError:
        # ε is below the left end of the domain (δ(ε) ≤ δ already at a negative ε): check ε = 0.
        if acc.compute_delta_upper(0.0, list(counts)) <= delta:
            return 0.0, 0.0, 0.0, None
        raise
    if not all(math.isfinite(v) for v in (lower, estimate, upper)):
        raise ValueError("ε is too large to account at these settings (the privacy loss leaves the accountant's "
                         "numerical range): use a larger noise_multiplier, a smaller sample_rate or fewer steps.")
    return float(max(0.0, lower)), float(max(0.0, estimate)), float(max(0.0, upper)), pmf_n


def composition_bounds(segments, delta: float) -> tuple[float, float, float]:
    """(lower, estimate, upper) ε of the composition of [(Kind, steps), ...], worst direction."""
    counts: dict[Kind, int] = {}
    for kind, steps in segments:
        if steps:
            counts[kind] = counts.get(kind, 0) + steps
    if not counts:
        return 0.0, 0.0, 0.0
    items = tuple(sorted(counts.items()))
    key = (items, delta)

    def compute():
        kinds = tuple(kind for kind, _ in items)
        steps = tuple(n for _, n in items)
        horizons = tuple(horizon(n) for n in steps)
        eps_error = eps_error_target(kinds, horizons, delta)
        per_direction = [
            direction_bounds(discretisation(direction, kinds, horizons, delta, eps_error), steps, delta)
            for direction in DIRECTIONS
        ]
        return tuple(max(b[i] for b in per_direction) for i in range(3))

    return CACHE.results.get_or_build(key, compute)


def epsilon_bounds(*, sample_rate: float, noise_multiplier: float, steps: int, delta: float,
                   group_size: int = 1) -> tuple[float, float, float]:
    """(lower, estimate, upper) bounds on ε after `steps` Poisson-sampled DP-SGD steps.

    The true ε lies in [lower, upper] (prv-accountant's certificate); [`epsilon`] reports `upper`.
    Same arguments as [`epsilon`].
    """
    kind = make_kind(sample_rate, noise_multiplier, group_size)
    return composition_bounds([(kind, check_steps(steps))], check_delta(delta))


def epsilon(*, sample_rate: float, noise_multiplier: float, steps: int, delta: float,
            group_size: int = 1) -> float:
    """ε of `steps` compositions of the Poisson-subsampled Gaussian (G = 1) or the mixture of Gaussians (G > 1).

    Affects nothing (it only measures): this is the ε the privacy card states for such a run.

    Args:
        sample_rate (`float`):
            q ∈ (0, 1]: probability that one unit (user for ULS, example for ELS and example-level)
            is in a batch.
        noise_multiplier (`float`):
            σ > 0: noise std divided by `max_grad_norm`.
        steps (`int`):
            T ≥ 0 optimizer steps.
        delta (`float`):
            δ ∈ (0, 1).
        group_size (`int`, *optional*, defaults to `1`):
            G ≥ 1. `1` for example-level and ULS user-level DP-SGD; the contribution bound for ELS,
            whose user-level ε comes from the mixture-of-Gaussians accountant.

    Returns:
        `float`: the upper bound on ε over both adjacency directions (never understated).

    Raises:
        ValueError: an argument is out of range (the message says which and what to change).

    Example:
        >>> round(epsilon(sample_rate=0.01, noise_multiplier=1.0, steps=1000, delta=1e-5), 1)
        1.8
    """
    return epsilon_bounds(sample_rate=sample_rate, noise_multiplier=noise_multiplier, steps=steps,
                          delta=delta, group_size=group_size)[2]
