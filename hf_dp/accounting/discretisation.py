"""prv-accountant's discretisation of a privacy random variable, with a mean that holds up.

prv-accountant (Gopi, Lee, Wutschitz 2021) discretises each step's privacy loss Y on a mesh,
shifts it so that its mean equals Y's (truncated) mean, composes by FFT, and certifies
[ε − eps_error, ε + eps_error] (their Theorem 5.5). The certificate needs that mean to be
right: an error μ_err per step shifts the composed loss by T·μ_err, which is not inside
eps_error. Where user-level DP lives (q ≤ 1e-3, σ ≤ 0.6, T ≥ 1e4) almost all of Y's mass sits
in one or two mesh cells, and any rule on the mesh (prv-accountant's quadrature of the CDF, or
Simpson's rule) is far off. So the mean here is an integral in the input space of the
noise (`MixtureOfGaussiansPRV.loss_moment`), checked against a second, coarser one and, when
they disagree, against adaptive quadrature; failing that, it raises instead of answering.
"""
from __future__ import annotations

import math

import numpy as np
from prv_accountant import composers
from prv_accountant.accountant import compute_safe_domain_size
from prv_accountant.discrete_privacy_random_variable import DiscretePrivacyRandomVariable
from prv_accountant.domain import Domain
from scipy.fft import irfft, next_fast_len

from .privacy_loss import MixtureOfGaussiansPRV

# Largest mesh: beyond it the mesh is coarsened (a larger, still certified, eps_error) so that
# memory stays bounded (a few arrays of this many float64) whatever the number of steps.
MAX_MESH_POINTS = 1 << 22
# The mean's tolerated error, as a share of eps_error spread over all steps.
MEAN_ERROR_SHARE = 1e-3
# Round-off of a float64 composition, bounded by twice the negative mass the FFT leaves at
# losses ≥ ε (where δ is read; an exact composition has none), as a share of delta_error:
# above it the composition is redone in long double (as prv-accountant's own PRVs are,
# ~4x slower; δ ≲ 1e-7 with long runs). In long double, prv-accountant's own bound (machine
# epsilon x mesh points) must stay below this share of delta_error, or no ε is returned.
ROUND_OFF_SHARE = 0.1
LONG_DOUBLE_SHARE = 999.0  # = (δ − delta_error) / delta_error: prv-accountant's exact criterion


class AccountingError(Exception):
    """An internal consistency check of the accountant failed: no ε is returned."""


class Discretisation:
    """prv-accountant's `PRVAccountant` for our privacy random variables, built from its own parts.

    Same steps as `PRVAccountant.__init__`: the domain [−L, L] from `compute_safe_domain_size`
    (RDP tail bounds), the mesh for `eps_error` from Gopi et al.'s Theorem 5.5, cell-centred
    masses normalised over the truncated domain and shifted to match the truncated mean, then
    `composers.Heterogeneous` (FFT self-composition per kind, convolution across kinds). The
    differences:

    - the domain is the smaller of prv-accountant's (RDP tail bounds) and a Chernoff bound on
      the truncated loss (`truncated_chernoff_half_width`: RDP explodes for large G at small σ);
    - the masses come from the random variable's small tails (`MixtureOfGaussiansPRV.tails`:
      full precision far in either tail, where a CDF near 1 rounds masses away);
    - the truncated mean is an integral in input space, checked (see the module docstring);
    - compositions are in float64 unless their round-off reaches δ's error budget;
    - the mesh has a fast FFT length (eps_error lowered slightly), at most `MAX_MESH_POINTS`
      (eps_error raised, still certified, when the steps would need more);
    - each kind's Fourier power F^n is kept, so the next step count costs one multiplication.
    """

    def __init__(self, prvs, horizons, eps_error: float, delta_error: float) -> None:
        half_width = min(compute_safe_domain_size(prvs, list(horizons), eps_error=eps_error, delta_error=delta_error),
                         truncated_chernoff_half_width(prvs, horizons, eps_error, delta_error))
        per_mesh = math.sqrt(sum(horizons) / 2 * math.log(12 / delta_error))  # eps_error / mesh
        size = min(2 * math.ceil(half_width * per_mesh / eps_error) + 2, MAX_MESH_POINTS)
        fast = next_fast_len(size, real=True)
        while fast % 2:
            fast = next_fast_len(fast + 1, real=True)
        mesh = half_width / (fast / 2 - 1.5)  # ⌈L/mesh⌉ = fast/2 − 1, mid-cell: safe from rounding
        self.eps_error = mesh * per_mesh
        self.delta_error = delta_error
        self.max_self_compositions = list(horizons)
        domain = Domain.create_aligned(-half_width, half_width, mesh)
        mean_tolerance = MEAN_ERROR_SHARE * self.eps_error / sum(horizons)
        self.composer = composers.Heterogeneous([discretise(prv, domain, mean_tolerance) for prv in prvs])
        self.long_double = False
        self._powers: dict[int, tuple[int, np.ndarray]] = {}

    def compute_composition(self, counts) -> DiscretePrivacyRandomVariable:
        """`composers.Heterogeneous.compute_composition`, with each kind's Fourier power F^n kept
        so that the next step count costs one multiplication (the ledger asks for n, n+1, ...)."""
        if any(n > h for n, h in zip(counts, self.max_self_compositions)):
            raise ValueError("Requested number of compositions exceeds the maximum number of compositions")
        parts = [self._self_compose(i, n) for i, n in enumerate(counts)]
        if len(parts) == 1:
            return parts[0]
        return composers.ConvolutionTree(parts).compute_composition([1] * len(parts))

    def check_round_off(self, composed: DiscretePrivacyRandomVariable, epsilon: float) -> bool:
        """Whether the composition's round-off above `epsilon` is within δ's error budget.

        δ(ε) sums the masses at losses ≥ ε; an exact composition has no negative mass, so twice
        the negative mass there measures the round-off in δ. When it is too large in float64 the
        masses switch to long double (and False is returned: compose again); in long double
        prv-accountant's own precision test applies, and failing it is an `AccountingError`.
        """
        if self.long_double:  # prv-accountant's own test for its long-double PRVs
            round_off = float(np.finfo(np.longdouble).eps) * len(composed.pmf)
            if round_off > LONG_DOUBLE_SHARE * self.delta_error:
                raise AccountingError(f"the composition's round-off ({round_off:.2g}) exceeds δ's error budget "
                                      f"({self.delta_error:.2g}) even in long double: use a larger delta.")
            return True
        negative = (composed.pmf < 0) & (composed.domain.ts() >= epsilon)
        if -2 * float(composed.pmf[negative].sum()) <= ROUND_OFF_SHARE * self.delta_error:
            return True
        self.long_double = True
        self.composer = composers.Heterogeneous([
            DiscretePrivacyRandomVariable(f.prvs[0].pmf.astype(np.longdouble), f.prvs[0].domain)
            for f in self.composer.self_composers])
        self._powers.clear()
        return False

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


def truncated_chernoff_half_width(prvs, horizons, eps_error: float, delta_error: float) -> float:
    """A domain half-width L with the same guarantees as prv-accountant's `compute_safe_domain_size`.

    That function needs P[Y_i > L] ≤ delta_error/(8T) for every step and P[Σ Y_i > L] ≤
    delta_error/4 for the composition (then adds 3), and gets them from RDP. For the mixture of
    Gaussians at large G and small σ the Rényi divergences are astronomically large (driven by
    mass below 1e-1000), and so is its L. Here instead: a cap c_i with T·P[Y_i > c_i] ≤
    delta_error/8 from the exact tails, and Chernoff on the capped losses,
    P[Σ min(Y_i, c_i) > L] ≤ exp(−λL + Σ T_i log E[e^{λ min(Y_i, c_i)}]) ≤ delta_error/8.
    """
    total = sum(horizons)
    caps = [loss_cap(prv, delta_error / (8 * total * len(prvs))) for prv in prvs]
    lambdas = np.array([x / 10.0 for x in range(1, 100)] + [float(a) for a in range(11, 63)])
    log_mgf = sum(n * prv.capped_log_mgf(lambdas, cap) for prv, n, cap in zip(prvs, horizons, caps))
    composed = float(np.min((log_mgf + math.log(8 / delta_error)) / lambdas))
    return max(composed, *caps, eps_error) + 3


def loss_cap(prv: MixtureOfGaussiansPRV, tail: float) -> float:
    """Smallest point c of a geometric grid with P[Y > c] ≤ `tail` (from the exact tails)."""
    grid = np.geomspace(1e-3, 1e5, 2000)
    upper, value = prv.tails(grid)
    survival = np.where(upper, value, 1.0 - value)
    below = np.flatnonzero(survival <= tail)
    return float(grid[below[0]]) if below.size else math.inf


def discretise(
    prv: MixtureOfGaussiansPRV, domain: Domain, mean_tolerance: float
) -> DiscretePrivacyRandomVariable:
    """Cell-centred masses of `prv` on `domain`, shifted to the truncated mean (prv-accountant's
    `CellCentred` discretiser, with the masses and the mean computed for precision)."""
    t_min, t_max, mesh = domain.t_min(), domain.t_max(), domain.dt()
    centres = domain.ts()
    edges = np.clip(np.append(centres - mesh / 2, centres[-1] + mesh / 2).astype(float), t_min, t_max)
    upper, value = prv.tails(edges)
    up_a, val_a, up_b, val_b = upper[:-1], value[:-1], upper[1:], value[1:]
    masses = np.maximum(np.where(up_a, val_a - val_b, np.where(up_b, 1.0 - val_a - val_b, val_b - val_a)), 0.0)
    total = float(masses.sum())
    pmf = masses / total
    shift = truncated_mean(prv, float(edges[0]), float(edges[-1]), total, mean_tolerance) - float(np.dot(centres, pmf))
    if not abs(shift) < mesh / 2:
        raise AccountingError(f"{prv!r}: the discrete mean differs from the continuous mean by {shift:.3g}, more "
                              f"than half a mesh cell ({mesh / 2:.3g}); no ε is returned.")
    return DiscretePrivacyRandomVariable(pmf, domain.shift_right(shift))


def truncated_mean(prv: MixtureOfGaussiansPRV, t_lo: float, t_hi: float, mass: float,
                   tolerance: float) -> float:
    """E[Y | t_lo < Y ≤ t_hi], to `tolerance` or an `AccountingError`.

    Gauss–Legendre on panels of 0.25σ (the answer) and 0.5σ (its check) in input space; when
    they differ by more than the tolerance, adaptive quadrature, whose own error estimate must
    then be within it.
    """
    fine = prv.loss_moment(t_lo, t_hi, panel=0.25)
    coarse = prv.loss_moment(t_lo, t_hi, panel=0.5)
    if abs(fine - coarse) <= tolerance * mass:
        return fine / mass
    adaptive, error = prv.loss_moment_adaptive(t_lo, t_hi)
    if error <= tolerance * mass and abs(adaptive - fine) <= max(abs(fine - coarse), error) * 10:
        return adaptive / mass
    raise AccountingError(
        f"{prv!r}: the mean privacy loss is not resolved to {tolerance:.2g} (Gauss–Legendre {fine / mass:.17g} "
        f"vs {coarse / mass:.17g}, adaptive {adaptive / mass:.17g} ± {error / mass:.2g}); no ε is returned.")
