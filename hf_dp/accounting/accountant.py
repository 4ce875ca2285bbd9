"""ε of DP-SGD runs, noise calibration, and the privacy ledger that travels with training.

Everything here composes the per-step privacy random variable of
[`~hf_dp.accounting.mechanisms.MixtureOfGaussiansMechanism`] with prv-accountant
(Gopi, Lee, Wutschitz 2021), once per adjacency direction (remove and add), and reports the
larger ε. The ε reported is prv-accountant's *upper* bound (estimate + its stated error), so it
is never understated; `epsilon_bounds` also gives the lower bound and the estimate.

Notation: σ = ``noise_multiplier``, q = ``sample_rate``, T = ``steps``,
G = ``group_size`` (``contribution_bound``), C = ``max_grad_norm`` (ε does not depend on C).

Precision and speed (prv-accountant's parameters, chosen here):

- ``eps_error`` (the width of the ε bound above the estimate) is ``EPS_ERROR_RELATIVE`` = 0.4 %
  of the run's ε, estimated first on a coarse discretisation (floored at ``EPS_ERROR_MIN`` =
  1e-3), so the reported ε sits about 0.4 % above the exact value whatever its size.
  prv-accountant's mesh, and so the cost, is proportional to √T / ``eps_error``.
- ``delta_error`` = ``DELTA_ERROR_RELATIVE`` · δ = δ/1000 (shifts ε by a negligible amount).
- ``max_self_compositions``: the discretisation is built for a *horizon* ≥ the number of steps,
  on the ladder ⌈2^(j/4)⌉, and reused for every step count up to it. So ε(T) is a deterministic
  function of (q, σ, G, T, δ): `epsilon()` before training, the ledger during training and
  `epsilon_after` all give the same number for the same steps, and a ledger asked about one more
  step at each training step rebuilds its discretisation only 4 times per doubling of T; in
  between, a step costs one multiplication in Fourier space and one inverse FFT.

prv-accountant's `PRVAccountant` is rebuilt here from its own parts (`_Discretisation`) to keep
its precision on the mixture-of-Gaussians mechanism's wide domains; see that class.

Raises `ValueError` with a message that says what to change for out-of-range arguments.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from functools import lru_cache
from typing import NamedTuple

import numpy as np
from prv_accountant import composers
from prv_accountant.accountant import compute_safe_domain_size
from prv_accountant.discrete_privacy_random_variable import DiscretePrivacyRandomVariable
from prv_accountant.domain import Domain
from scipy.fft import irfft, next_fast_len
from scipy.optimize import brentq

from .mechanisms import DIRECTIONS, RDP_ORDERS, MixtureOfGaussiansMechanism

__all__ = [
    "PrivacyAccountant",
    "describe_mechanism",
    "epsilon",
    "epsilon_bounds",
    "group_privacy_epsilon",
    "noise_multiplier",
]

EPS_ERROR_RELATIVE = 0.004
EPS_ERROR_MIN = 1e-3
DELTA_ERROR_RELATIVE = 1e-3
NOISE_MULTIPLIER_RANGE = (0.1, 1000.0)
# Calibration stops when the bracket [σ_lo, σ_hi] (σ_lo fails, σ_hi meets the target) is this
# narrow, relatively: the σ returned is within 0.1 % of the smallest one that meets the target.
NOISE_MULTIPLIER_RTOL = 1e-3
_HORIZON_STEPS_PER_DOUBLING = 4
_GROUP_PROFILE_ORDERS = tuple(sorted(set(RDP_ORDERS) | {
    64.0, 80.0, 96.0, 128.0, 160.0, 192.0, 256.0, 384.0, 512.0, 768.0, 1024.0, 1536.0, 2048.0, 4096.0}))


class Kind(NamedTuple):
    """The parameters of one step: (q, σ, G)."""

    sample_rate: float
    noise_multiplier: float
    group_size: int


# ---- argument checks: one message per problem, saying what to change --------------------------

def _check_sample_rate(sample_rate) -> float:
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float, np.number)) \
            or not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate={sample_rate!r} must be in (0, 1]: it is the probability that one "
                         "unit is in a batch (expected batch size / number of units).")
    return float(sample_rate)


def _check_noise_multiplier(noise_multiplier) -> float:
    if isinstance(noise_multiplier, bool) or not isinstance(noise_multiplier, (int, float, np.number)) \
            or not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"noise_multiplier={noise_multiplier!r} must be a positive number "
                         "(noise std = noise_multiplier · max_grad_norm).")
    return float(noise_multiplier)


def _check_count(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
            and not (isinstance(value, (float, np.floating)) and float(value).is_integer()):
        raise ValueError(f"{name}={value!r} must be an integer ≥ {minimum}.")
    if value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer ≥ {minimum}.")
    return int(value)


def _check_delta(delta) -> float:
    if isinstance(delta, bool) or not isinstance(delta, (int, float, np.number)) or not 0 < delta < 1:
        raise ValueError(f"delta={delta!r} must be in (0, 1); a common choice is 1/(10 · number of users).")
    return float(delta)


def _kind(sample_rate, noise_multiplier, group_size) -> Kind:
    return Kind(_check_sample_rate(sample_rate), _check_noise_multiplier(noise_multiplier),
                _check_count(group_size, "group_size", 1))


def describe_mechanism(group_size: int = 1) -> str:
    """One line naming the mechanism accounted for a contribution bound G (for cards and logs)."""
    group_size = _check_count(group_size, "group_size", 1)
    if group_size == 1:
        return "Poisson-subsampled Gaussian mechanism (DP-SGD), add/remove adjacency"
    return (f"mixture-of-Gaussians mechanism: Poisson-sampled examples, at most G={group_size} per user, "
            "sensitivity ~ Binomial(G, q) (ELS user-level DP-SGD), add/remove adjacency")


# ---- the precision policy ----------------------------------------------------------------------

def _horizon(steps: int) -> int:
    """Smallest ⌈2^(j/4)⌉ ≥ steps: the discretisation of a run is built for this many steps."""
    if steps <= 1:
        return 1
    j = max(0, math.floor(_HORIZON_STEPS_PER_DOUBLING * math.log2(steps)) - 2)
    while math.ceil(2 ** (j / _HORIZON_STEPS_PER_DOUBLING)) < steps:
        j += 1
    return math.ceil(2 ** (j / _HORIZON_STEPS_PER_DOUBLING))


@lru_cache(maxsize=256)
def _mechanism(kind: Kind, direction: str) -> MixtureOfGaussiansMechanism:
    return MixtureOfGaussiansMechanism(kind.sample_rate, kind.noise_multiplier, kind.group_size, direction)


def _rdp_curve(kinds, counts, direction: str, orders=RDP_ORDERS) -> np.ndarray:
    """Σ_i T_i · D_α for each order α (the RDP of the composition in one direction)."""
    total = np.zeros(len(orders))
    for kind, count in zip(kinds, counts):
        prv = _mechanism(kind, direction)
        total += count * np.array([prv.rdp(a) for a in orders])
    return total


def _rdp_epsilon(kinds, counts, delta: float) -> float:
    """The RDP ε (prv-accountant's conversion) of the composition, larger direction."""
    orders = np.asarray(RDP_ORDERS)
    worst = 0.0
    for direction in DIRECTIONS:
        rdp = _rdp_curve(kinds, counts, direction)
        with np.errstate(invalid="ignore"):
            eps = rdp - np.log(delta * orders) / (orders - 1) + np.log1p(-1 / orders)
        worst = max(worst, float(np.nanmin(eps)))
    return worst


class _Discretisation:
    """prv-accountant's `PRVAccountant` for our mechanisms, built from its own parts.

    Same steps as `PRVAccountant.__init__`: the domain [−L, L] from `compute_safe_domain_size`
    (RDP tail bounds, from `MixtureOfGaussiansMechanism.rdp`), the mesh for `eps_error` from
    Gopi et al.'s Theorem 5.5, cell-centred masses normalised over the truncated domain and
    shifted to match the truncated PRV's mean, then `composers.Heterogeneous` (FFT
    self-composition per kind, convolution across kinds). The differences:

    - the masses come from the mechanism's small tails (`MixtureOfGaussiansMechanism.tails`:
      full precision far in either tail, where a CDF near 1 rounds masses away);
    - the truncated mean comes from `_truncated_mean` (Simpson's rule on those tails at the
      cell edges) instead of quadrature of the CDF, which loses ~1e-8 × L and fails on the wide
      domains of the mixture-of-Gaussians mechanism ("Discrete mean differs from continuous mean
      significantly"; it does so for prv-accountant's own Poisson-subsampled Gaussian too);
    - `eps_error` is lowered slightly so that the mesh has a fast FFT length;
    - each kind's Fourier power F^n is kept, so the next step count costs one multiplication.
    """

    def __init__(self, prvs, horizons, eps_error: float, delta_error: float) -> None:
        half_width = compute_safe_domain_size(prvs, list(horizons), eps_error=eps_error, delta_error=delta_error)
        per_mesh = math.sqrt(sum(horizons) / 2 * math.log(12 / delta_error))  # eps_error / mesh
        size = 2 * math.ceil(half_width * per_mesh / eps_error) + 2  # Domain.create_aligned's size
        fast = next_fast_len(size, real=True)
        while fast % 2:
            fast = next_fast_len(fast + 1, real=True)
        mesh = half_width / (fast / 2 - 1.5)  # ⌈L/mesh⌉ = fast/2 − 1, mid-cell: safe from rounding
        self.eps_error = mesh * per_mesh
        self.delta_error = delta_error
        self.max_self_compositions = list(horizons)
        domain = Domain.create_aligned(-half_width, half_width, mesh)
        self.composer = composers.Heterogeneous([self._discretise(prv, domain) for prv in prvs])
        self._powers: dict[int, tuple[int, np.ndarray]] = {}

    @staticmethod
    def _discretise(prv: MixtureOfGaussiansMechanism, domain: Domain) -> DiscretePrivacyRandomVariable:
        t_min, t_max, mesh = domain.t_min(), domain.t_max(), domain.dt()
        centres = domain.ts()
        edges = np.clip(np.append(centres - mesh / 2, centres[-1] + mesh / 2).astype(float), t_min, t_max)
        upper, value = prv.tails(edges)
        up_a, val_a, up_b, val_b = upper[:-1], value[:-1], upper[1:], value[1:]
        masses = np.maximum(np.where(up_a, val_a - val_b, np.where(up_b, 1.0 - val_a - val_b, val_b - val_a)), 0.0)
        pmf = masses / masses.sum()
        shift = _truncated_mean(edges, upper, value) - float(np.dot(centres, pmf))
        if not abs(shift) < mesh / 2:
            raise RuntimeError("Discrete mean differs from continuous mean significantly.")
        return DiscretePrivacyRandomVariable(pmf, domain.shift_right(shift))

    def compute_composition(self, counts) -> DiscretePrivacyRandomVariable:
        """`composers.Heterogeneous.compute_composition`, with each kind's Fourier power F^n kept
        so that the next step count costs one multiplication (the ledger asks for n, n+1, ...)."""
        if any(n > h for n, h in zip(counts, self.max_self_compositions)):
            raise ValueError("Requested number of compositions exceeds the maximum number of compositions")
        parts = [self._self_compose(i, n) for i, n in enumerate(counts)]
        if len(parts) == 1:
            return parts[0]
        return composers.ConvolutionTree(parts).compute_composition([1] * len(parts))

    def _self_compose(self, index: int, count: int) -> DiscretePrivacyRandomVariable:
        # composers.Fourier.compute_composition, with a cached power
        fourier = self.composer.self_composers[index]
        last = self._powers.get(index)
        if last is not None and last[0] == count:
            power = last[1]
        elif last is not None and last[0] == count - 1:
            power = last[1] * fourier.F
        else:
            power = fourier.F ** count
        self._powers[index] = (count, power)
        pmf = irfft(power)
        shift = count - 1 + (len(pmf) // 2 if count % 2 == 0 else 0)
        domain = fourier.domain.shift_right(fourier.domain.shifts() * (count - 1))
        return DiscretePrivacyRandomVariable(np.roll(pmf, shift), domain)

    def compute_delta_upper(self, eps: float, counts) -> float:
        """prv-accountant's upper bound on δ(ε) (`PRVAccountant.compute_delta`'s last entry)."""
        return float(self.compute_composition(counts).compute_delta_estimate(eps - self.eps_error) + self.delta_error)


def _integrate(values: np.ndarray, step: float) -> float:
    """∫ of equally spaced samples: composite Simpson (3/8 rule on the last three intervals when
    their number is odd), trapezoid below three intervals."""
    n = values.size - 1
    if n < 1:
        return 0.0
    if n < 3:
        return float(step * (values.sum() - 0.5 * (values[0] + values[-1])))
    head, total = (n, 0.0) if n % 2 == 0 else (n - 3, 3 * step / 8 * float(
        values[-4] + 3 * values[-3] + 3 * values[-2] + values[-1]))
    if head:
        part = values[:head + 1]
        total += step / 3 * float(part[0] + part[-1] + 4 * part[1:-1:2].sum() + 2 * part[2:-1:2].sum())
    return total


def _truncated_mean(edges: np.ndarray, upper: np.ndarray, value: np.ndarray) -> float:
    """E[Y | edges[0] < Y ≤ edges[-1]] from the tails at the cell edges.

    With F = P[Y ≤ t] below a split edge s and S = P[Y > t] above it, integration by parts gives
    ∫ t dF = s − a·F(a) − b·S(b) − ∫_a^s F + ∫_s^b S over (a, b], with no difference of large
    numbers however wide the domain. The integrals use Simpson's rule on the equally spaced
    interior edges (4th order: the discrete mean's O(mesh²) offset is resolved) and the
    trapezoid on the two half cells at the ends, where the tails are negligible.
    prv-accountant's own quadrature of the CDF loses ~1e-8 x the domain width, which is too much
    next to a fine mesh on the wide domains of the mixture-of-Gaussians mechanism.
    """
    lower_idx = np.flatnonzero(~upper)
    split = int(lower_idx[-1]) if lower_idx.size else 0
    lower_tail = np.where(upper, 1.0 - value, value)  # F (imprecise only where unused)
    upper_tail = np.where(upper, value, 1.0 - value)  # S
    a, b, n = edges[0], edges[-1], edges.size - 1
    step = edges[2] - edges[1] if n > 2 else edges[1] - edges[0]

    def integral(tail: np.ndarray, lo: int, hi: int) -> float:  # ∫ over edges[lo]..edges[hi]
        if hi <= lo:
            return 0.0
        total = 0.0
        if lo == 0:  # half cell at the left end
            total += 0.5 * (tail[0] + tail[1]) * (edges[1] - edges[0])
            lo = 1
        if hi == n and hi > lo:  # half cell at the right end
            total += 0.5 * (tail[n - 1] + tail[n]) * (edges[n] - edges[n - 1])
            hi = n - 1
        return total + _integrate(tail[lo:hi + 1], step)

    moment = (edges[split] - a * lower_tail[0] - b * upper_tail[-1]
              - integral(lower_tail, 0, split) + integral(upper_tail, split, n))
    mass = 1.0 - lower_tail[0] - upper_tail[-1]
    return float(moment / mass)


def _build_accountant(direction: str, kinds, horizons, delta: float, eps_error: float) -> _Discretisation:
    return _Discretisation([_mechanism(kind, direction) for kind in kinds], horizons, eps_error,
                           DELTA_ERROR_RELATIVE * delta)


class _LRU(OrderedDict):
    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def get_or_build(self, key, build):
        if key in self:
            self.move_to_end(key)
            return self[key]
        value = build()
        self[key] = value
        while len(self) > self.size:
            self.popitem(last=False)
        return value


# Each discretisation holds a few arrays of the mesh size (up to ~1e6 points); keep a handful.
_ACCOUNTANTS = _LRU(6)
_RESULTS = _LRU(4096)
_EPS_ERRORS = _LRU(256)
_COARSE = _LRU(8)


def _coarse_accountants(kinds, horizons, delta: float) -> tuple[_Discretisation, ...]:
    """A coarse discretisation per direction, its stated error 3 % of the RDP ε: ~8x cheaper than
    the final one. Its *estimate* is much more accurate than its stated error (~0.3 %): it sets
    the final `eps_error` and guides the noise calibration."""
    def build():
        coarse_error = max(EPS_ERROR_MIN, 0.03 * _rdp_epsilon(kinds, horizons, delta))
        return tuple(_build_accountant(d, kinds, horizons, delta, coarse_error) for d in DIRECTIONS)

    return _COARSE.get_or_build((kinds, horizons, delta), build)


def _eps_error(kinds, horizons, delta: float) -> float:
    """`EPS_ERROR_RELATIVE` of the ε at the horizon (a coarse estimate), at least `EPS_ERROR_MIN`."""
    def compute():
        scale = max(_direction_bounds(acc, horizons, delta)[1] for acc in _coarse_accountants(kinds, horizons, delta))
        return max(EPS_ERROR_MIN, EPS_ERROR_RELATIVE * scale)

    return _EPS_ERRORS.get_or_build((kinds, horizons, delta), compute)


def _accountant(direction: str, kinds, horizons, delta: float, eps_error: float) -> _Discretisation:
    key = (direction, kinds, horizons, delta, eps_error)
    return _ACCOUNTANTS.get_or_build(key, lambda: _build_accountant(direction, kinds, horizons, delta, eps_error))


def _epsilon_from_pmf(pmf_n, delta: float, delta_error: float, eps_error: float):
    """prv-accountant's `DiscretePrivacyRandomVariable.compute_epsilon`, faster.

    The same formula — δ(t) = Σ_{s≥t} p_s (1 − e^{t−s}) on the grid, ε where it crosses δ ∓
    delta_error, ± eps_error — on the part of the domain where ε ≥ −1 can lie, in float64.
    The suffix sums of non-negative terms carry a relative error below n·2⁻⁵³ ≈ 1e-10 (n ≤ 1e6
    terms), i.e. an absolute error ~1e-10·P[Y > ε] in δ, orders of magnitude below
    delta_error = δ/1000 since P[Y > ε] is a small multiple of δ. Returns None when ε may lie
    further left (the caller falls back to prv-accountant's own routine).
    """
    if pmf_n.log_pmc_inf != 0.0:
        return None
    if np.finfo(np.longdouble).eps * len(pmf_n.domain) > delta - delta_error:
        raise ValueError("Floating point errors will dominate for such small values of delta.")
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


def _direction_bounds(acc: _Discretisation, counts, delta: float) -> tuple[float, float, float]:
    try:
        pmf_n = acc.compute_composition(list(counts))
        bounds = _epsilon_from_pmf(pmf_n, delta, acc.delta_error, acc.eps_error)  # fast path
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
            return 0.0, 0.0, 0.0
        raise
    if not all(math.isfinite(v) for v in (lower, estimate, upper)):
        raise ValueError("ε is too large to account at these settings (the privacy loss leaves the accountant's "
                         "numerical range): use a larger noise_multiplier, a smaller sample_rate or fewer steps.")
    return float(max(0.0, lower)), float(max(0.0, estimate)), float(max(0.0, upper))


def _composition_bounds(segments, delta: float) -> tuple[float, float, float]:
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
        horizons = tuple(_horizon(n) for n in steps)
        eps_error = _eps_error(kinds, horizons, delta)
        per_direction = [
            _direction_bounds(_accountant(direction, kinds, horizons, delta, eps_error), steps, delta)
            for direction in DIRECTIONS
        ]
        return tuple(max(b[i] for b in per_direction) for i in range(3))

    return _RESULTS.get_or_build(key, compute)


# ---- the public functions ----------------------------------------------------------------------

def epsilon_bounds(*, sample_rate: float, noise_multiplier: float, steps: int, delta: float,
                   group_size: int = 1) -> tuple[float, float, float]:
    """(lower, estimate, upper) bounds on ε after `steps` Poisson-sampled DP-SGD steps.

    The true ε lies in [lower, upper] (prv-accountant's guarantee); [`epsilon`] reports `upper`.
    Same arguments as [`epsilon`].
    """
    kind = _kind(sample_rate, noise_multiplier, group_size)
    steps = _check_count(steps, "steps", 0)
    delta = _check_delta(delta)
    return _composition_bounds([(kind, steps)], delta)


def epsilon(*, sample_rate: float, noise_multiplier: float, steps: int, delta: float,
            group_size: int = 1) -> float:
    """ε of `steps` compositions of the Poisson-subsampled Gaussian (G = 1) or the MoG mechanism (G > 1).

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


def noise_multiplier(*, target_epsilon: float, delta: float, sample_rate: float, steps: int,
                     group_size: int = 1) -> float:
    """The smallest σ whose [`epsilon`] meets `target_epsilon`, to 0.1 % (bracketing search).

    A coarse discretisation locates the root cheaply; secant steps on the full computation then
    close a bracket σ_lo < σ ≤ σ_hi (σ_lo spends more than the target, σ_hi does not) to 0.1 %,
    with bisection as the fallback; σ_hi is returned.

    Affects accounting: training with the returned σ for `steps` steps spends at most
    `target_epsilon` (the same computation as [`epsilon`] and the ledger).

    Args:
        target_epsilon (`float`): ε > 0 to meet.
        delta (`float`): δ ∈ (0, 1).
        sample_rate (`float`): q ∈ (0, 1].
        steps (`int`): T ≥ 1.
        group_size (`int`, *optional*, defaults to `1`): G ≥ 1 (see [`epsilon`]).

    Returns:
        `float`: σ ∈ [0.1, 1000] with `epsilon(σ) ≤ target_epsilon`, at most 0.1 % above the
        smallest such σ (σ = 0.1 when even that meets the target).

    Raises:
        ValueError: an argument is out of range, or even σ = 1000 spends more than the target
            (the message says what to change).

    Example:
        >>> sigma = noise_multiplier(target_epsilon=3.0, delta=1e-5, sample_rate=0.01, steps=1000)
        >>> epsilon(sample_rate=0.01, noise_multiplier=sigma, steps=1000, delta=1e-5) <= 3.0
        True
    """
    if isinstance(target_epsilon, bool) or not isinstance(target_epsilon, (int, float, np.number)) \
            or not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"target_epsilon={target_epsilon!r} must be a positive number.")
    target = float(target_epsilon)
    kind = _kind(sample_rate, 1.0, group_size)
    steps = _check_count(steps, "steps", 1)
    delta = _check_delta(delta)
    q, group = kind.sample_rate, kind.group_size
    sigma_min, sigma_max = NOISE_MULTIPLIER_RANGE
    rtol = NOISE_MULTIPLIER_RTOL
    spent: dict[float, float] = {}

    def spends(sigma: float) -> float:
        """The ε `epsilon()` reports at σ; ∞ where σ is too small for the accountant to resolve ε."""
        if sigma not in spent:
            try:
                spent[sigma] = _composition_bounds([(Kind(q, sigma, group), steps)], delta)[2]
            except (RuntimeError, ValueError, FloatingPointError, OverflowError):
                spent[sigma] = math.inf
        return spent[sigma]

    def infeasible() -> ValueError:
        return ValueError(
            f"No noise_multiplier up to {sigma_max:g} reaches ε={target:g} at δ={delta:g} with sample_rate={q:.4g}, "
            f"{steps} steps" + (f" and contribution bound G={group}" if group > 1 else "")
            + ": raise the target ε, or take fewer steps or a smaller sample rate"
            + (" or a smaller G." if group > 1 else ".")
        )

    # Cheap feasibility check at σ_max: the RDP ε bounds the true ε; only a target near it needs
    # the full computation.
    if _rdp_epsilon((Kind(q, sigma_max, group),), (steps,), delta) > target / 2 and spends(sigma_max) > target:
        raise infeasible()
    # 1. Locate the root on a cheap proxy (a coarse discretisation): σ and d log ε / d log σ.
    guess, slope = _coarse_root(q, group, steps, delta, target)
    # 2. Secant steps on the real computation (in log σ, log ε), then close the bracket
    #    lo < σ* ≤ hi (lo never meets the target, hi always does) to within rtol by probing
    #    just above and just below the root estimate.
    lo, hi = sigma_min, sigma_max
    if guess is None and spends(sigma_min) <= target:
        return sigma_min
    sigma = guess
    for _ in range(10):
        if sigma is None or hi / lo <= 1 + rtol:
            break
        if spends(sigma) <= target:
            hi = min(hi, sigma)
        else:
            lo = max(lo, sigma)
        if hi / lo <= 1 + rtol:
            break
        known = sorted((abs(math.log(e / target)), s_, e) for s_, e in spent.items()
                       if math.isfinite(e) and e > 0)
        if not known:
            sigma = math.sqrt(lo * hi)
            continue
        if len(known) >= 2 and known[0][2] != known[1][2]:
            (_, s0, e0), (_, s1, e1) = known[:2]
            slope = (math.log(e1) - math.log(e0)) / (math.log(s1) - math.log(s0))
        s0, e0 = known[0][1], known[0][2]
        root = math.exp(math.log(s0) + math.log(target / e0) / slope) if slope and slope < 0 else math.sqrt(lo * hi)
        # Probe above the root until hi is within rtol/2 of it, then below it for lo.
        sigma = root * (1 + rtol / 2) if hi > root * (1 + rtol) else root / (1 + rtol / 2)
        if not lo < sigma < hi:
            sigma = math.sqrt(lo * hi)
    # 3. Bisection for whatever is left (no usable guess).
    while hi / lo > 1 + rtol:
        mid = math.sqrt(lo * hi)
        if spends(mid) <= target:
            hi = mid
        else:
            lo = mid
    if lo == sigma_min and spends(sigma_min) <= target:
        return sigma_min
    if spends(hi) > target:  # only σ_max can be unverified here
        raise infeasible()
    return hi


def _coarse_root(q: float, group: int, steps: int, delta: float, target: float):
    """(σ, d log ε / d log σ) where a coarse discretisation predicts `epsilon()` to reach the target.

    `epsilon()` reports (estimate at δ − delta_error) + eps_error; the coarse discretisation's
    estimate is within ~0.5 % of the first term and `_eps_error` gives the second, so this lands
    within a fraction of a percent of the answer at a fraction of the cost. The caller refines
    on the real computation. (None, None) when the root is outside [σ_min, σ_max] or the proxy
    fails.
    """
    horizon = _horizon(steps)
    sigma_min, sigma_max = NOISE_MULTIPLIER_RANGE

    def predicted(log_sigma: float) -> float:
        kind = Kind(q, math.exp(log_sigma), group)
        try:
            fine_error = _eps_error((kind,), (horizon,), delta)
            estimate = max(_direction_bounds(acc, [steps], delta)[1]
                           for acc in _coarse_accountants((kind,), (horizon,), delta))
        except (RuntimeError, ValueError, FloatingPointError, OverflowError):
            return math.inf  # ε beyond what the accountant resolves: far above any sane target
        return estimate + fine_error - target

    # Bracket by doubling/halving from σ = 1, then Brent's method on log σ.
    lo = hi = 0.0
    if predicted(lo) > 0:
        while predicted(hi) > 0:
            lo, hi = hi, hi + math.log(2)
            if hi > math.log(sigma_max):
                return None, None
    else:
        while predicted(lo) <= 0:
            lo, hi = lo - math.log(2), lo
            if lo < math.log(sigma_min):
                return None, None
    try:
        root = brentq(predicted, lo, hi, xtol=1e-4, rtol=1e-5, maxiter=60)
    except (ValueError, RuntimeError):
        return None, None
    step = math.log(1.02)
    above = predicted(root + step) + target
    slope = (math.log(above) - math.log(target)) / step if 0 < above < math.inf else -1.0
    return math.exp(root), min(slope, -0.1)


def group_privacy_epsilon(*, sample_rate: float, noise_multiplier: float, steps: int, delta: float,
                          group_size: int) -> float:
    """User-level ε from the example-level guarantee by black-box group privacy (loose; for comparison).

    An (ε', δ')-DP mechanism is (G·ε', G·e^{(G−1)ε'}·δ')-DP for groups of G examples. This returns
    the smallest G·ε' such that the example-level run (G = 1, same q, σ, T) is (ε', δ')-DP with
    G·e^{(G−1)ε'}·δ' ≤ `delta`. The example-level privacy profile δ'(ε') is bounded by
    prv-accountant (where its precision reaches) and by RDP (for the tiny δ' that large G needs),
    whichever is smaller. Cards show it beside the mixture-of-Gaussians ε of ELS, which accounts
    the same users tightly.

    Args: as [`epsilon`], with `group_size` (`int`) the group size G ≥ 1.

    Returns:
        `float`: the group-privacy ε (∞ when no ε' satisfies the constraint).

    Raises:
        ValueError: an argument is out of range.
    """
    kind = _kind(sample_rate, noise_multiplier, 1)
    group = _check_count(group_size, "group_size", 1)
    steps = _check_count(steps, "steps", 0)
    delta = _check_delta(delta)
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
    rdp = {d: _rdp_curve((kind,), (steps,), d, orders=_GROUP_PROFILE_ORDERS) for d in DIRECTIONS}
    profiles = []
    horizon = _horizon(steps)
    eps_error = _eps_error((kind,), (horizon,), delta_scale)
    for acc in (_accountant(d, (kind,), (horizon,), delta_scale, eps_error) for d in DIRECTIONS):
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


# ---- the ledger ---------------------------------------------------------------------------------

class PrivacyAccountant:
    """Ledger of DP-SGD steps (q, σ, G per step) and the ε they spend, saved with every checkpoint.

    Steps may change q, σ or G mid-run; consecutive steps with equal parameters are merged into
    one segment. ε composes all segments in both adjacency directions (the larger is reported).
    Affects nothing by itself: it records what the trainer did.

    Example:
        >>> accountant = PrivacyAccountant()
        >>> accountant.step(sample_rate=0.01, noise_multiplier=1.0, steps=500)
        >>> accountant.epsilon_after(1e-5, steps=500) == epsilon(
        ...     sample_rate=0.01, noise_multiplier=1.0, steps=1000, delta=1e-5)
        True
        >>> state = accountant.state_dict()  # JSON-safe, restore with load_state_dict
    """

    STATE_FORMAT = 1

    def __init__(self) -> None:
        self._segments: list[list] = []  # [Kind, steps]
        self._pure_dp: list[dict] = []  # [{"label": str, "epsilon": float}]: data-dependent choices

    def record_pure_dp(self, label: str, epsilon: float) -> None:
        """Record one ε-DP release made from the private data (e.g. a DP quantile that chose G).

        It composes with the DP-SGD steps by basic composition: `epsilon(delta)` adds its ε
        (affects accounting). Raises `ValueError` for a non-positive or non-finite ε.
        """
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float, np.number)) \
                or not (epsilon > 0 and math.isfinite(epsilon)):
            raise ValueError(f"epsilon={epsilon!r} of the {label!r} release must be a positive finite number.")
        self._pure_dp.append({"label": str(label), "epsilon": float(epsilon)})

    @property
    def pure_dp(self) -> list[dict]:
        """The ε-DP releases recorded with `record_pure_dp`, oldest first."""
        return [dict(r) for r in self._pure_dp]

    @property
    def pure_dp_epsilon(self) -> float:
        """Total ε of the recorded ε-DP releases (added to the DP-SGD ε)."""
        return float(sum(r["epsilon"] for r in self._pure_dp))

    def step(self, *, sample_rate: float, noise_multiplier: float, group_size: int = 1, steps: int = 1) -> None:
        """Record `steps` DP-SGD steps with these parameters (affects accounting)."""
        kind = _kind(sample_rate, noise_multiplier, group_size)
        steps = _check_count(steps, "steps", 0)
        if steps == 0:
            return
        if self._segments and self._segments[-1][0] == kind:
            self._segments[-1][1] += steps
        else:
            self._segments.append([kind, steps])

    @property
    def steps(self) -> int:
        """Total steps recorded."""
        return sum(n for _, n in self._segments)

    @property
    def history(self) -> list[dict]:
        """The segments, oldest first: dicts with sample_rate, noise_multiplier, group_size, steps."""
        return [{**kind._asdict(), "steps": n} for kind, n in self._segments]

    @property
    def mechanism(self) -> str:
        """A one-line description of what was composed."""
        if not self._segments:
            return "no steps"
        groups = sorted({kind.group_size for kind, _ in self._segments})
        parts = "; ".join(describe_mechanism(g) for g in groups)
        return f"{self.steps} steps of {parts}"

    def epsilon_bounds(self, delta: float) -> tuple[float, float, float]:
        """(lower, estimate, upper) ε of all recorded steps and ε-DP releases at `delta` ((0, 0, 0) when empty)."""
        extra = self.pure_dp_epsilon
        return tuple(e + extra for e in _composition_bounds([tuple(s) for s in self._segments], _check_delta(delta)))

    def epsilon(self, delta: float) -> float:
        """ε spent so far at `delta`: the upper bound, never understated (0 when empty)."""
        return self.epsilon_bounds(delta)[2]

    def epsilon_after(self, delta: float, *, steps: int = 1, sample_rate: float | None = None,
                      noise_multiplier: float | None = None, group_size: int | None = None) -> float:
        """ε if `steps` more steps were taken (parameters default to the last segment's).

        The trainer asks this before every step so that it stops before exceeding its target.
        Equals `epsilon(delta)` after those steps are recorded (the same cached computation); one
        more step than last time costs ~10-50 ms (one Fourier-space multiplication and inverse FFT
        per adjacency direction), a new discretisation only when the steps pass a horizon.

        Args:
            delta (`float`): δ ∈ (0, 1).
            steps (`int`, *optional*, defaults to `1`): further steps.
            sample_rate, noise_multiplier, group_size (*optional*): their parameters, defaulting
                to the last segment's (required for the first steps of an empty ledger).

        Raises:
            ValueError: out-of-range arguments, or an empty ledger without parameters.
        """
        steps = _check_count(steps, "steps", 0)
        last = self._segments[-1][0] if self._segments else None
        if steps == 0 and sample_rate is None and noise_multiplier is None and group_size is None:
            return self.epsilon(delta)
        if last is None and (sample_rate is None or noise_multiplier is None):
            raise ValueError("The ledger is empty: pass sample_rate and noise_multiplier (and group_size for ELS) "
                             "to epsilon_after.")
        kind = _kind(
            last.sample_rate if sample_rate is None else sample_rate,
            last.noise_multiplier if noise_multiplier is None else noise_multiplier,
            (last.group_size if last is not None else 1) if group_size is None else group_size,
        )
        return self.pure_dp_epsilon + _composition_bounds(
            [tuple(s) for s in self._segments] + [(kind, steps)], _check_delta(delta))[2]

    def state_dict(self) -> dict:
        """JSON-safe state: {"format": 1, "segments": [{sample_rate, noise_multiplier, group_size, steps}]}."""
        return {"format": self.STATE_FORMAT, "segments": self.history, "pure_dp": self.pure_dp}

    def load_state_dict(self, state: dict) -> None:
        """Restore from `state_dict()` output (validated; the ledger is replaced, never merged).

        Raises:
            ValueError: the state is not a ledger written by this class.
        """
        if not isinstance(state, dict) or state.get("format") != self.STATE_FORMAT \
                or not isinstance(state.get("segments"), list) or not isinstance(state.get("pure_dp", []), list):
            raise ValueError(f"Not a PrivacyAccountant state (expected {{'format': {self.STATE_FORMAT}, "
                             f"'segments': [...]}}), got {state!r:.200}.")
        segments = []
        for i, seg in enumerate(state["segments"]):
            keys = {"sample_rate", "noise_multiplier", "group_size", "steps"}
            if not isinstance(seg, dict) or set(seg) != keys:
                raise ValueError(f"Ledger segment {i} must have exactly the keys {sorted(keys)}, got {seg!r:.200}.")
            try:
                kind = _kind(seg["sample_rate"], seg["noise_multiplier"], seg["group_size"])
                steps = _check_count(seg["steps"], "steps", 1)
            except ValueError as error:
                raise ValueError(f"Ledger segment {i} is invalid: {error}") from error
            if segments and segments[-1][0] == kind:
                segments[-1][1] += steps
            else:
                segments.append([kind, steps])
        pure_dp = []
        for i, release in enumerate(state.get("pure_dp", [])):
            if not isinstance(release, dict) or set(release) != {"label", "epsilon"}:
                raise ValueError(f"Ledger pure_dp entry {i} must have exactly the keys ['epsilon', 'label'], "
                                 f"got {release!r:.200}.")
            epsilon = release["epsilon"]
            if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) \
                    or not (epsilon > 0 and math.isfinite(epsilon)):
                raise ValueError(f"Ledger pure_dp entry {i} has an invalid epsilon {epsilon!r}.")
            pure_dp.append({"label": str(release["label"]), "epsilon": float(epsilon)})
        self._segments = segments
        self._pure_dp = pure_dp

    def __repr__(self) -> str:
        return f"PrivacyAccountant(steps={self.steps}, segments={len(self._segments)})"
