"""The per-step privacy loss random variable of DP-SGD (a prv-accountant `PrivacyRandomVariable`).

One DP-SGD step adds N(0, σ²C²) noise to a sum of clipped gradients. After scaling by C, a
privacy unit that holds K of the sampled items shifts the output by at most K (the worst case
is all its clipped gradients aligned), so one step is the pair

    P = N(0, σ²)                         (the dataset without the unit)
    Q = Σ_k w_k N(k, σ²),  w_k = Binom(k; G, q)   (the dataset with it)

- G = 1 is the Poisson-subsampled Gaussian: example-level DP-SGD, and ULS user-level DP-SGD
  (a sampled user contributes one clipped mean gradient);
- G > 1 is ELS user-level DP-SGD: examples are Poisson-sampled with rate q and a user holds at
  most G of them, so K ~ Binomial(G, q) (Charles et al. 2024, the "mixture of Gaussians").

Its privacy loss L(x) = log Q(x)/P(x) is convex and increasing in x, so the distribution of the
loss follows from inverting L ([`~hf_dp.accounting.mixture_loss`]: L and its inverse). This
module holds the distribution of the loss (its tails, CDF and cell masses, which prv-accountant
discretises) and its moments (the truncated mean the discretisation is checked with, and the
capped moment-generating function of the Chernoff bound); [`~hf_dp.accounting.renyi`] holds its
Rényi divergences.

Add/remove adjacency has two directions, both accounted (the ε reported is the larger):
- ``"remove"``: the loss log Q/P with x ~ Q (a unit's data is removed from the dataset that was
  trained on). This is prv-accountant's ``PoissonSubsampledGaussianMechanism`` when G = 1.
- ``"add"``: the loss log P/Q with x ~ P.
In dp-accounting's terms these are ``AdjacencyType.REMOVE`` and ``AdjacencyType.ADD``.

Notation (the project's names in code, Greek letters only in this math):
σ = ``noise_multiplier``, q = ``sample_rate``, T = ``steps``,
G = ``group_size`` (the ``contribution_bound``), C = ``max_grad_norm``.

This module is pure math: numpy, scipy and prv-accountant only.
"""
from __future__ import annotations

import math
import warnings

import numpy as np
from prv_accountant import PrivacyRandomVariable
from scipy import integrate
from scipy.special import log_ndtr, ndtr

from .mixture_loss import CHUNK, MixtureLoss, log_sum_exp
from .renyi import RDP_ORDERS, add_divergences, remove_divergences

__all__ = ["DIRECTIONS", "MixtureOfGaussiansPRV"]

DIRECTIONS = ("remove", "add")

# Mixture components whose weight w_k is below this carry no mass that any float64 CDF value
# can resolve (CDF values near 1 have 1e-16 resolution); they are left out of the mass sums
# (never out of the privacy loss).
_NEGLIGIBLE_WEIGHT = 1e-30
# Gauss–Legendre rule of the privacy loss's moments, and the half-width in standard deviations
# beyond which a Gaussian component has no mass a float64 can hold (φ(38) ≈ 1e-314).
_GAUSS_LEGENDRE = np.polynomial.legendre.leggauss(24)
_Z_RANGE = 38.0


def _ndtr(z: float) -> float:
    """Standard normal CDF of one float, accurate in the lower tail."""
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


class MixtureOfGaussiansPRV(PrivacyRandomVariable):
    """Privacy loss random variable of one Poisson-sampled DP-SGD step with contribution bound G.

    A [`prv_accountant.PrivacyRandomVariable`]: prv-accountant discretises it through `cdf` /
    `probability` and sizes its domain through `rdp`. With `group_size=1` it is the
    Poisson-subsampled Gaussian; with G > 1 the mixture of Gaussians of ELS (see the module
    docstring for the pair of distributions).

    Args:
        sample_rate (`float`):
            q, the Poisson sampling probability of one item (a user for ULS, an example for ELS
            and example-level DP-SGD), in (0, 1].
        noise_multiplier (`float`):
            σ > 0: the noise standard deviation divided by the clipping norm C.
        group_size (`int`, *optional*, defaults to `1`):
            G ≥ 1, the most items one privacy unit can hold (the contribution bound).
        direction (`str`, *optional*, defaults to `"remove"`):
            `"remove"` (loss log Q/P under Q) or `"add"` (loss log P/Q under P).

    Raises:
        ValueError: for parameters outside the ranges above.

    Example:
        >>> prv = MixtureOfGaussiansPRV(sample_rate=0.01, noise_multiplier=1.0, group_size=4)
        >>> prv.inverse_privacy_loss(prv.privacy_loss(1.5))  # L is increasing: the CDF inverts it
        array([1.5])
    """

    def __init__(self, sample_rate: float, noise_multiplier: float, group_size: int = 1,
                 direction: str = "remove") -> None:
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate={sample_rate}: must be in (0, 1].")
        if not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
            raise ValueError(f"noise_multiplier={noise_multiplier}: must be a positive number.")
        if int(group_size) != group_size or group_size < 1:
            raise ValueError(f"group_size={group_size}: must be an integer ≥ 1.")
        if direction not in DIRECTIONS:
            raise ValueError(f"direction={direction!r}: must be one of {DIRECTIONS}.")
        self.sample_rate = float(sample_rate)
        self.noise_multiplier = float(noise_multiplier)
        self.group_size = int(group_size)
        self.direction = direction
        self.loss_function = MixtureLoss(self.sample_rate, self.noise_multiplier, self.group_size)

        # Components that carry mass for Q's CDF.
        k = np.arange(self.group_size + 1, dtype=float)
        heavy = self.loss_function.log_weights >= math.log(_NEGLIGIBLE_WEIGHT)
        self._mass_k = k[heavy]
        self._mass_w = np.exp(self.loss_function.log_weights[heavy])
        self._mass_terms = list(zip(self._mass_k.tolist(), self._mass_w.tolist()))
        self._split_x = self._median_of_q() if direction == "remove" else 0.0
        self._rdp_cache: dict[float, float] = {}
        self._scalar_cache: dict[float, tuple[bool, float]] = {}

    def __repr__(self) -> str:
        return (f"MixtureOfGaussiansPRV(sample_rate={self.sample_rate!r}, "
                f"noise_multiplier={self.noise_multiplier!r}, group_size={self.group_size}, "
                f"direction={self.direction!r})")

    # ---- the privacy loss and its inverse (hf_dp.accounting.mixture_loss) ----------------------------

    def privacy_loss(self, x) -> np.ndarray:
        """L(x) = log Q(x)/P(x) = log Σ_k w_k exp((2kx − k²)/2σ²) (the "remove" loss at x)."""
        return self.loss_function(x)

    def inverse_privacy_loss(self, loss) -> np.ndarray:
        """x with L(x) = `loss`; −inf where `loss` ≤ log w_0 = G·log(1−q) (below L's range)."""
        return self.loss_function.inverse(loss)

    # ---- distribution of the privacy loss --------------------------------------------------

    def _median_of_q(self) -> float:
        """x where Q's CDF is 1/2 (points above it use Q's survival function for precision)."""
        sigma = self.noise_multiplier
        lo, hi = -40.0 * sigma, self.group_size + 40.0 * sigma
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if float((self._mass_w * ndtr((mid - self._mass_k) / sigma)).sum()) < 0.5:
                lo = mid
            else:
                hi = mid
            if hi - lo <= 1e-12 * max(1.0, abs(mid)):
                break
        return 0.5 * (lo + hi)

    def tails(self, t) -> tuple[np.ndarray, np.ndarray]:
        """For each loss value t: (upper, value) with value = P[Y > t] where `upper`, else P[Y ≤ t].

        Each point gets the tail that is below 1/2 there, so masses far in either tail keep full
        relative precision (a CDF near 1 would lose them). The accountant discretises from these.
        """
        t = np.atleast_1d(np.asarray(t, dtype=float))
        sigma = self.noise_multiplier
        if self.direction == "remove":
            # Y = L(X), X ~ Q: P[Y ≤ t] = Q(X ≤ x(t)).
            x = self.inverse_privacy_loss(t)
            upper = x > self._split_x
            value = np.zeros_like(x)
            for start in range(0, x.size, CHUNK):
                part = slice(start, start + CHUNK)
                for side in (False, True):
                    sel = np.flatnonzero(upper[part] == side) + start
                    sel = sel[np.isfinite(x[sel])]
                    if sel.size:
                        value[sel] = self._q_tail(x[sel], side)
            return upper, value
        # "add": Y = −L(X), X ~ P = N(0, σ²): P[Y ≤ t] = P(X ≥ x(−t)).
        x = self.inverse_privacy_loss(-t)
        upper = x < 0
        value = ndtr(np.where(upper, x, -x) / sigma)  # x = −inf: Y ≤ t surely, upper tail 0
        return upper, value

    def _q_tail(self, x: np.ndarray, upper: bool) -> np.ndarray:
        """Q(X > x) if `upper` else Q(X ≤ x), summing only components that matter for these points.

        A component is left out when, at every point, it is below 1e-20 of the largest one
        there (the tail is monotone in x, so the extremes of the points decide).
        """
        sigma, k, w = self.noise_multiplier, self._mass_k, self._mass_w
        sign = -1.0 if upper else 1.0
        far, near = (x.min(), x.max()) if upper else (x.max(), x.min())
        with np.errstate(divide="ignore"):
            log_w = np.log(w)
            best_term = log_w + log_ndtr(sign * (far - k) / sigma)    # each term's largest value
            floor = np.max(log_w + log_ndtr(sign * (near - k) / sigma))  # the tail's smallest value
        keep = best_term >= floor - 46.0
        z = (sign / sigma) * (x - k[keep][:, None])  # (K, points)
        return w[keep] @ ndtr(z, out=z)

    def _tail_scalar(self, t: float) -> tuple[bool, float]:
        """`tails` for one point in plain Python, memoised. hf_dp's own discretisation never asks
        for single points; prv-accountant's stock `PRVAccountant` does (it integrates the CDF
        point by point for its mean), which is how the tests cross-check this random variable."""
        cached = self._scalar_cache.get(t)
        if cached is not None:
            return cached
        sigma = self.noise_multiplier
        x = self.loss_function.inverse_scalar(t if self.direction == "remove" else -t)
        if self.direction == "remove":
            if x == -math.inf:
                result = (False, 0.0)
            else:
                upper = x > self._split_x
                sign = -1.0 if upper else 1.0
                result = (upper, sum(w * _ndtr(sign * (x - k) / sigma) for k, w in self._mass_terms))
        else:
            upper = x < 0
            result = (upper, _ndtr((x if upper else -x) / sigma) if x != -math.inf else 0.0)
        if len(self._scalar_cache) < 20_000:
            self._scalar_cache[t] = result
        return result

    # ---- moments of the privacy loss (the discretisation's mean check, the Chernoff bound) ---------

    def loss_moment(self, t_lo: float, t_hi: float, panel: float = 0.25) -> float:
        """E[Y · 1{t_lo < Y ≤ t_hi}] by Gauss–Legendre quadrature in input space.

        Y = L(X) with X ~ Q ("remove") or Y = −L(X) with X ~ P ("add"), and L is increasing, so
        the event is an interval of x and the moment is Σ_k w_k ∫ ±L(k + σz) φ(z) dz over it:
        a smooth integrand, integrated per component on panels `panel` wide in z (24 nodes
        each), whatever how the mass of Y piles up in a few cells of the loss mesh.
        """
        nodes, weights = _GAUSS_LEGENDRE
        total = 0.0
        for k, w, z_lo, z_hi, sign in self._moment_pieces(t_lo, t_hi):
            panels = max(1, math.ceil((z_hi - z_lo) / panel))
            edges = np.linspace(z_lo, z_hi, panels + 1)
            half = 0.5 * (edges[1] - edges[0])
            z = (0.5 * (edges[:-1] + edges[1:])[:, None] + half * nodes).ravel()
            values = self.privacy_loss(k + self.noise_multiplier * z) * np.exp(-0.5 * z * z)
            total += sign * w * half * float(np.dot(np.tile(weights, panels), values)) / math.sqrt(2 * math.pi)
        return total

    def loss_moment_adaptive(self, t_lo: float, t_hi: float) -> tuple[float, float]:
        """`loss_moment` by adaptive quadrature (scipy's QUADPACK): (value, error estimate)."""
        value = error = 0.0
        for k, w, z_lo, z_hi, sign in self._moment_pieces(t_lo, t_hi):
            def integrand(z, k=k):
                return float(self.privacy_loss(k + self.noise_multiplier * z)) * math.exp(-0.5 * z * z)

            with warnings.catch_warnings():  # its error estimate is what the caller checks
                warnings.simplefilter("ignore", integrate.IntegrationWarning)
                part, part_error = integrate.quad(integrand, z_lo, z_hi, limit=1000, epsabs=1e-16, epsrel=1e-13,
                                                  points=[p for p in (-1.0, 0.0, 1.0) if z_lo < p < z_hi] or None)
            value += sign * w * part / math.sqrt(2 * math.pi)
            error += w * part_error / math.sqrt(2 * math.pi)
        return value, error

    def capped_log_mgf(self, lambdas, cap: float) -> np.ndarray:
        """log E[exp(λ · min(Y, cap))] for each λ > 0 (Gauss–Legendre in input space, split at the
        cap's x): finite for every λ, unlike the Rényi divergences of the uncapped loss."""
        lambdas = np.asarray(lambdas, dtype=float)
        if not math.isfinite(cap):
            return np.full(lambdas.shape, math.inf)
        nodes, weights = _GAUSS_LEGENDRE
        sigma = self.noise_multiplier
        if self.direction == "remove":
            x_cap, sign, components = float(self.inverse_privacy_loss(cap)[0]), 1.0, self._mass_terms
        else:  # −L(x) ≥ cap  ⟺  x ≤ x(−cap)
            x_cap, sign, components = float(self.inverse_privacy_loss(-cap)[0]), -1.0, [(0.0, 1.0)]
        log_terms = []
        for k, w in components:
            split = min(max((x_cap - k) / sigma, -_Z_RANGE), _Z_RANGE)
            edges = np.unique(np.r_[np.arange(-_Z_RANGE, _Z_RANGE + 1.0), split])
            half = 0.5 * np.diff(edges)
            z = (0.5 * (edges[:-1] + edges[1:])[:, None] + half[:, None] * nodes).ravel()
            log_node = (np.log((half[:, None] * weights).ravel()) - 0.5 * z * z + math.log(w)
                        - 0.5 * math.log(2 * math.pi))
            capped = np.minimum(sign * self.privacy_loss(k + sigma * z), cap)
            log_terms.append(lambdas[:, None] * capped + log_node)
        return log_sum_exp(np.concatenate(log_terms, axis=1), axis=1)

    def _moment_pieces(self, t_lo: float, t_hi: float):
        """(k, w_k, z_lo, z_hi, sign) per mixture component: the event t_lo < Y ≤ t_hi in z."""
        sigma = self.noise_multiplier
        if self.direction == "remove":
            x_lo, x_hi = self.inverse_privacy_loss([t_lo, t_hi])
            components, sign = self._mass_terms, 1.0
        else:  # −L(x) ∈ (t_lo, t_hi]  ⟺  x ∈ [x(−t_hi), x(−t_lo))
            x_lo, x_hi = self.inverse_privacy_loss([-t_hi, -t_lo])
            components, sign = [(0.0, 1.0)], -1.0
        for k, w in components:
            z_lo = max(-_Z_RANGE, (x_lo - k) / sigma)
            z_hi = min(_Z_RANGE, (x_hi - k) / sigma)
            if z_hi > z_lo:
                yield k, w, z_lo, z_hi, sign

    def cdf(self, t):
        """P[Y ≤ t] for the privacy loss Y of this direction."""
        if np.ndim(t) == 0:
            upper, value = self._tail_scalar(float(t))
            return 1.0 - value if upper else value
        upper, value = self.tails(t)
        return np.where(upper, 1.0 - value, value)

    def sf(self, t):
        """P[Y > t], accurate far in the upper tail."""
        if np.ndim(t) == 0:
            upper, value = self._tail_scalar(float(t))
            return value if upper else 1.0 - value
        upper, value = self.tails(t)
        return np.where(upper, value, 1.0 - value)

    def probability(self, a, b):
        """P[a < Y ≤ b] elementwise, each cell from the tail that keeps its precision."""
        a = np.asarray(a, dtype=float)
        b = np.asarray(b, dtype=float)
        if a.ndim == 1 and a.size > 1 and a.shape == b.shape and np.all(a[1:] >= a[:-1]) \
                and np.max(np.abs(a[1:] - b[:-1])) <= 1e-12 * max(1.0, float(np.max(np.abs(b)))):
            # Adjacent cells (prv-accountant's discretisation): evaluate each shared edge once.
            upper, value = self.tails(np.concatenate([a, b[-1:]]))
            up_a, val_a, up_b, val_b = upper[:-1], value[:-1], upper[1:], value[1:]
        else:
            up_a, val_a = self.tails(a)
            up_b, val_b = self.tails(b)
        mass = np.where(
            up_a, val_a - val_b,  # both in the upper tail (b ≥ a)
            np.where(up_b, 1.0 - val_a - val_b, val_b - val_a),
        )
        mass = np.maximum(mass, 0.0)
        return mass.reshape(np.broadcast(a, b).shape)

    # ---- Rényi divergences (hf_dp.accounting.renyi; prv-accountant sizes its domain with them) --

    def rdp(self, alpha: float) -> float:
        """Rényi divergence of order α between this direction's pair (an upper bound): D_α(Q‖P)
        for "remove", D_α(P‖Q) for "add". The orders prv-accountant asks for are computed in one batch."""
        alpha = float(alpha)
        if alpha not in self._rdp_cache:
            orders = sorted(set(RDP_ORDERS) | {alpha})
            divergences = remove_divergences if self.direction == "remove" else add_divergences
            self._rdp_cache.update(zip(orders, divergences(self.loss_function, orders)))
        return self._rdp_cache[alpha]
