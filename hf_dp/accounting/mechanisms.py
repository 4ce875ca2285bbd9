"""The per-step privacy random variable of DP-SGD, on prv-accountant.

One DP-SGD step adds N(0, σ²C²) noise to a sum of clipped gradients. After scaling by C, a
privacy unit that holds K of the sampled items shifts the output by at most K (the worst case
is all its clipped gradients aligned), so one step is the pair

    P = N(0, σ²)                         (the dataset without the unit)
    Q = Σ_k w_k N(k, σ²),  w_k = Binom(k; G, q)   (the dataset with it)

- G = 1 is the Poisson-subsampled Gaussian: example-level DP-SGD, and ULS user-level DP-SGD
  (a sampled user contributes one clipped mean gradient);
- G > 1 is ELS user-level DP-SGD: examples are Poisson-sampled with rate q and a user holds at
  most G of them, so K ~ Binomial(G, q) (Charles et al. 2024, the "mixture of Gaussians").

Its privacy loss L(x) = log Q(x)/P(x) = log Σ_k w_k exp((2kx − k²)/2σ²) is convex and increasing
in x, so the distribution of the loss follows from inverting L. With y = exp(x/σ²), L(x) = s reads
Σ_{k≥1} w_k e^{-k²/2σ²} y^k = e^s − w_0, a polynomial with positive coefficients: its log is
convex in log y with slope in [1, G], and Newton's method from an upper bound converges
monotonically in a few steps.

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
from scipy.special import gammaln, log_ndtr, ndtr

__all__ = ["DIRECTIONS", "RDP_ORDERS", "MixtureOfGaussiansMechanism", "binomial_log_weights"]

DIRECTIONS = ("remove", "add")

# prv-accountant's default RDP orders (prv_accountant.other_accountants.RDP): it asks `rdp` for
# exactly these when it sizes the discretisation domain, so they are computed in one batch.
RDP_ORDERS = tuple([1.0 + x / 10.0 for x in range(1, 100)] + [float(a) for a in range(12, 64)])

# Mixture components whose weight w_k is below this carry no mass that any float64 CDF value
# can resolve (CDF values near 1 have 1e-16 resolution); they are left out of the mass sums
# (never out of the privacy loss).
_NEGLIGIBLE_WEIGHT = 1e-30
# Points are processed in chunks so that the (points x components) work arrays stay small.
_CHUNK = 1 << 15
# Sorted inputs: exact Newton on every this-many-th point, interpolation in between.
_ANCHOR_SPACING = 32
# Largest sum of orders x G for the exact integer-order Rényi moments of the "remove" direction;
# higher orders report +inf (a valid, useless bound: prv-accountant then uses the lower orders).
_MAX_RDP_WORK = 4096
# Gauss–Legendre rule of the privacy loss's moments, and the half-width in standard deviations
# beyond which a Gaussian component has no mass a float64 can hold (φ(38) ≈ 1e-314).
_GAUSS_LEGENDRE = np.polynomial.legendre.leggauss(24)
_Z_RANGE = 38.0


def _ndtr(z: float) -> float:
    """Standard normal CDF of one float, accurate in the lower tail."""
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


def binomial_log_weights(group_size: int, sample_rate: float) -> np.ndarray:
    """log Binom(k; G, q) for k = 0..G (−inf where the weight is 0)."""
    k = np.arange(group_size + 1, dtype=float)
    log_choose = gammaln(group_size + 1) - gammaln(k + 1) - gammaln(group_size - k + 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        log_q = math.log(sample_rate)
        log_1mq = math.log1p(-sample_rate) if sample_rate < 1 else -math.inf
        rest = group_size - k
        log_w = log_choose + k * log_q + np.where(rest > 0, rest * log_1mq, 0.0)
    return log_w


def _logsumexp(values: np.ndarray, axis: int) -> np.ndarray:
    """log Σ exp along `axis`, −inf for all −inf rows, without warnings."""
    top = np.max(values, axis=axis, keepdims=True)
    safe_top = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        out = np.log(np.sum(np.exp(values - safe_top), axis=axis)) + np.squeeze(safe_top, axis=axis)
    return np.where(np.isfinite(np.squeeze(top, axis=axis)), out, np.squeeze(top, axis=axis))


class MixtureOfGaussiansMechanism(PrivacyRandomVariable):
    """Privacy random variable of one Poisson-sampled DP-SGD step with contribution bound G.

    A [`prv_accountant.PrivacyRandomVariable`]: prv-accountant discretises it through `cdf` /
    `probability` and sizes its domain through `rdp`. With `group_size=1` it is the
    Poisson-subsampled Gaussian mechanism; with G > 1 the mixture-of-Gaussians mechanism of ELS
    (see the module docstring for the pair of distributions).

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
        >>> prv = MixtureOfGaussiansMechanism(sample_rate=0.01, noise_multiplier=1.0, group_size=4)
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

        variance = self.noise_multiplier ** 2
        self._variance = variance
        k = np.arange(self.group_size + 1, dtype=float)
        self._log_w = binomial_log_weights(self.group_size, self.sample_rate)  # (G+1,)
        self._log_w0 = float(self._log_w[0])  # log(1-q)·G, −inf when q = 1
        # Newton coefficients for k ≥ 1: log a_k = log w_k − k²/2σ² (−inf for zero weights).
        positive = np.isfinite(self._log_w[1:])
        self._newton_k = k[1:][positive]
        self._newton_log_a = (self._log_w[1:] - k[1:] ** 2 / (2 * variance))[positive]
        # Components that carry mass for Q's CDF.
        heavy = self._log_w >= math.log(_NEGLIGIBLE_WEIGHT)
        self._mass_k = k[heavy]
        self._mass_w = np.exp(self._log_w[heavy])
        self._newton_terms = list(zip(self._newton_k.tolist(), self._newton_log_a.tolist()))
        self._mass_terms = list(zip(self._mass_k.tolist(), self._mass_w.tolist()))
        self._split_x = self._median_of_q() if direction == "remove" else 0.0
        self._rdp_cache: dict[float, float] = {}
        self._scalar_cache: dict[float, tuple[bool, float]] = {}

    def __repr__(self) -> str:
        return (f"MixtureOfGaussiansMechanism(sample_rate={self.sample_rate!r}, "
                f"noise_multiplier={self.noise_multiplier!r}, group_size={self.group_size}, "
                f"direction={self.direction!r})")

    # ---- the privacy loss and its inverse ------------------------------------------------------

    def privacy_loss(self, x) -> np.ndarray:
        """L(x) = log Q(x)/P(x) = log Σ_k w_k exp((2kx − k²)/2σ²) (the "remove" loss at x)."""
        x = np.asarray(x, dtype=float)
        k = np.arange(self.group_size + 1, dtype=float)
        terms = self._log_w + (2 * x[..., None] * k - k ** 2) / (2 * self._variance)
        return _logsumexp(terms, axis=-1)

    def inverse_privacy_loss(self, loss) -> np.ndarray:
        """x with L(x) = `loss`; −inf where `loss` ≤ log w_0 = G·log(1−q) (below L's range)."""
        loss = np.atleast_1d(np.asarray(loss, dtype=float))
        flat = loss.ravel()
        if self._newton_k.size == 1:  # G = 1 or q = 1: one term, φ is linear
            valid, log_r = self._log_r(flat)
            with np.errstate(invalid="ignore"):
                u = (log_r - self._newton_log_a[0]) / self._newton_k[0]
            return np.where(valid, self._variance * u, -np.inf).reshape(loss.shape)
        if flat.size >= 8 * _ANCHOR_SPACING:
            if np.all(flat[1:] >= flat[:-1]):
                return self._invert_sorted(flat).reshape(loss.shape)
            if np.all(flat[1:] <= flat[:-1]):
                return self._invert_sorted(flat[::-1])[::-1].reshape(loss.shape)
        out = np.empty_like(flat)
        for start in range(0, flat.size, _CHUNK):
            out[start:start + _CHUNK] = self._invert_chunk(flat[start:start + _CHUNK])
        return out.reshape(loss.shape)

    def _log_r(self, loss: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(valid, log(e^s − w_0)): the right-hand side of the polynomial equation for L(x) = s."""
        if math.isfinite(self._log_w0):
            gap = loss - self._log_w0
            valid = gap > 0
            with np.errstate(divide="ignore", invalid="ignore"):
                log_r = self._log_w0 + gap + np.log(-np.expm1(-np.where(valid, gap, 1.0)))
            return valid, log_r
        return np.isfinite(loss), loss

    def _phi(self, u: np.ndarray, k: np.ndarray, log_a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """φ(u) = log Σ a_k e^{ku} and φ'(u) over the given terms."""
        z = log_a[:, None] + k[:, None] * u  # (K, points): reductions run along the long axis
        top = z.max(axis=0)
        z -= top
        np.exp(z, out=z)
        total = z.sum(axis=0)
        return top + np.log(total), (k @ z) / total

    def _invert_sorted(self, loss: np.ndarray) -> np.ndarray:
        """Inverse on sorted points (prv-accountant's mesh): exact Newton on every
        `_ANCHOR_SPACING`-th point, cubic Hermite interpolation of u(log R) in between, then one
        Newton step, which squares the tiny interpolation error; points whose step is not tiny
        are solved from scratch."""
        valid, log_r = self._log_r(loss)
        x = np.full(loss.shape, -np.inf)
        idx = np.flatnonzero(valid)
        if idx.size < 8 * _ANCHOR_SPACING:
            x[idx] = self._invert_chunk(loss[idx])
            return x
        v = log_r[idx]
        anchors = np.unique(np.r_[np.arange(0, idx.size, _ANCHOR_SPACING), idx.size - 1])
        u_anchor = self._invert_chunk(loss[idx[anchors]]) / self._variance
        _, slope_anchor = self._phi(u_anchor, self._newton_k, self._newton_log_a)
        v_anchor, du_dv = v[anchors], 1.0 / slope_anchor
        # Cubic Hermite on each segment between anchors, in s = (v − v_j)/(v_{j+1} − v_j) ∈ [0, 1].
        width = np.diff(v_anchor)
        slope_lo, slope_hi = width * du_dv[:-1], width * du_dv[1:]
        rise = np.diff(u_anchor)
        quad, cubic = 3 * rise - 2 * slope_lo - slope_hi, slope_lo + slope_hi - 2 * rise
        counts = np.append(np.diff(anchors), 1)  # the last point is the last anchor (s = 0 of a
        start_v, start_u = np.append(v_anchor[:-1], v_anchor[-1]), u_anchor  # zero-width segment)
        with np.errstate(divide="ignore", invalid="ignore"):
            inv_width = np.append(np.where(width > 0, 1.0 / width, 0.0), 0.0)
        s = (v - np.repeat(start_v, counts)) * np.repeat(inv_width, counts)
        coeff = [np.repeat(np.append(c, 0.0), counts) for c in (slope_lo, quad, cubic)]
        u = np.repeat(start_u, counts) + s * (coeff[0] + s * (coeff[1] + s * coeff[2]))
        k_all, log_a_all = self._newton_k, self._newton_log_a
        # A term's weight relative to φ: e^{log a_k + k u − φ(u)}, exact at the anchors, and it
        # moves by at most (k + G)·Δu ≪ 1 between neighbouring anchors.
        weight_at_anchor = log_a_all[:, None] + k_all[:, None] * u_anchor - v_anchor  # (K, anchors)
        redo = []
        for start in range(0, idx.size, _CHUNK):
            part = slice(start, start + _CHUNK)
            first = max(0, np.searchsorted(anchors, start, side="right") - 1)
            last = min(anchors.size, np.searchsorted(anchors, start + _CHUNK) + 1)
            relevant = np.any(weight_at_anchor[:, first:last] >= -45.0, axis=1)
            phi, slope = self._phi(u[part], k_all[relevant], log_a_all[relevant])
            step = (phi - v[part]) / slope
            u[part] -= step
            redo.append(np.flatnonzero(~(np.abs(step) <= 1e-9 * np.maximum(1.0, np.abs(u[part])))) + start)
        x[idx] = self._variance * u
        redo = np.concatenate(redo)
        if redo.size:
            x[idx[redo]] = self._invert_chunk(loss[idx[redo]])
        return x

    def _invert_chunk(self, loss: np.ndarray) -> np.ndarray:
        # Solve φ(u) = log R with φ(u) = log Σ_{k≥1} a_k e^{ku}, R = e^s − w_0, x = σ²u.
        valid, log_r = self._log_r(loss)
        x = np.full(loss.shape, -np.inf)
        idx = np.flatnonzero(valid)
        if idx.size == 0:
            return x
        log_r = log_r[idx]
        k, log_a = self._newton_k, self._newton_log_a
        # Upper start: the single term that reaches log R first puts φ above log R there.
        starts = (log_r[:, None] - log_a) / k  # (points, K)
        u = starts.min(axis=1)
        # Newton only lowers u, so a term below log R − log K − 40 at the start stays negligible
        # (relative weight < e^-40) at every iterate: leave it out.
        reach = log_a + k * u[:, None] - (log_r - math.log(k.size) - 40.0)[:, None]
        relevant = np.any(reach >= 0, axis=0)
        k, log_a = k[relevant], log_a[relevant]
        active = np.arange(idx.size)
        for _ in range(200):
            phi, slope = self._phi(u[active], k, log_a)
            step = (phi - log_r[active]) / slope
            u[active] -= step
            done = np.abs(step) <= 1e-13 * np.maximum(1.0, np.abs(u[active]))
            active = active[~done]
            if active.size == 0:
                break
        else:  # pragma: no cover - Newton on a convex function from above always converges
            raise RuntimeError("inverting the privacy loss did not converge")
        x[idx] = self._variance * u
        return x

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
            for start in range(0, x.size, _CHUNK):
                part = slice(start, start + _CHUNK)
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
        point by point for its mean), which is how the tests cross-check this mechanism."""
        cached = self._scalar_cache.get(t)
        if cached is not None:
            return cached
        sigma = self.noise_multiplier
        x = self._invert_scalar(t if self.direction == "remove" else -t)
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

    def _invert_scalar(self, loss: float) -> float:
        """`inverse_privacy_loss` for one point in plain Python (same Newton iteration)."""
        if math.isfinite(self._log_w0):
            gap = loss - self._log_w0
            if not gap > 0:
                return -math.inf
            log_r = self._log_w0 + gap + math.log(-math.expm1(-gap))
        else:
            if not math.isfinite(loss):
                return -math.inf
            log_r = loss
        terms = self._newton_terms
        u = min((log_r - log_a) / k for k, log_a in terms)
        for _ in range(200):
            top = max(log_a + k * u for k, log_a in terms)
            weights = [(k, math.exp(log_a + k * u - top)) for k, log_a in terms]
            total = sum(w for _, w in weights)
            step = (top + math.log(total) - log_r) * total / sum(k * w for k, w in weights)
            u -= step
            if abs(step) <= 1e-13 * max(1.0, abs(u)):
                return self._variance * u
        raise RuntimeError("inverting the privacy loss did not converge")  # pragma: no cover

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
            loss = np.minimum(sign * self.privacy_loss(k + sigma * z), cap)
            log_terms.append(lambdas[:, None] * loss + log_node)
        return _logsumexp(np.concatenate(log_terms, axis=1), axis=1)

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

    # ---- Rényi divergences (prv-accountant sizes its domain with them) -----------------------

    def rdp(self, alpha: float) -> float:
        """Rényi divergence of order α between this direction's pair (an upper bound).

        "remove": D_α(Q‖P), exact at integer α from the moments E_P[(Q/P)^n] = Σ_s c_s e^{s²/2σ²}
        (c = the n-fold self-convolution of w_k e^{−k²/2σ²}), by quadrature at fractional α.
        "add": D_α(P‖Q) by quadrature of the log-concave integrand P·(P/Q)^{α−1}.
        """
        alpha = float(alpha)
        if alpha not in self._rdp_cache:
            orders = sorted(set(RDP_ORDERS) | {alpha})
            values = self._rdp_remove(orders) if self.direction == "remove" else self._rdp_add(orders)
            self._rdp_cache.update(zip(orders, values))
        return self._rdp_cache[alpha]

    def _rdp_remove(self, orders) -> list[float]:
        integers = sorted({int(a) for a in orders if float(a).is_integer() and a > 1})
        fractions = sorted({a for a in orders if not float(a).is_integer() and a > 1})
        values = {}
        values.update(self._rdp_remove_integer(integers))
        values.update(self._rdp_remove_fractional(fractions))
        return [values.get(float(a), math.inf) if a > 1 else values.get(float(a), 0.0) for a in orders]

    def _rdp_remove_integer(self, orders) -> dict[float, float]:
        """Exact D_n(Q‖P) = log Σ_s c_s e^{s²/2σ²} / (n − 1), c = n-fold convolution of w_k e^{−k²/2σ²}."""
        if not orders:
            return {}
        if self.group_size == 1:  # closed form (as TF Privacy): Σ_i C(n,i) q^i (1−q)^{n−i} e^{(i²−i)/2σ²}
            out = {}
            for n in orders:
                i = np.arange(n + 1, dtype=float)
                log_terms = binomial_log_weights(n, self.sample_rate) + (i ** 2 - i) / (2 * self._variance)
                out[float(n)] = float(_logsumexp(log_terms, axis=0)) / (n - 1)
            return out
        top = min(max(orders), max(2, _MAX_RDP_WORK // self.group_size))
        log_a = self._log_w - np.arange(self.group_size + 1) ** 2 / (2 * self._variance)
        out = {}
        coeffs = np.zeros(1)  # log c_s of the 0-fold convolution: c_0 = 1
        for n in range(1, top + 1):
            shifted = np.full((coeffs.size + self.group_size, self.group_size + 1), -np.inf)
            for k in range(self.group_size + 1):
                shifted[k:k + coeffs.size, k] = coeffs + log_a[k]
            coeffs = _logsumexp(shifted, axis=1)
            if n in orders:
                s = np.arange(coeffs.size, dtype=float)
                out[float(n)] = float(_logsumexp(coeffs + s ** 2 / (2 * self._variance), axis=0)) / (n - 1)
        return out

    def _rdp_remove_fractional(self, orders) -> dict[float, float]:
        """D_α(Q‖P) = log ∫ N(x; 0, σ²) e^{αL(x)} dx / (α − 1) by quadrature on a fine grid.

        The integrand's modes lie in [0, αG] and are at least as wide as N(0, σ²); the grid
        spans 14σ beyond them with spacing σ/20.
        """
        if not orders:
            return {}
        sigma = self.noise_multiplier
        lo, hi = -14.0 * sigma, max(orders) * self.group_size + 14.0 * sigma
        points = min(400_001, int(math.ceil((hi - lo) / (sigma / 20.0))) + 1)
        x = np.linspace(lo, hi, points)
        loss = np.concatenate([self.privacy_loss(x[i:i + _CHUNK]) for i in range(0, points, _CHUNK)])
        log_base = -x ** 2 / (2 * self._variance) - math.log(sigma * math.sqrt(2 * math.pi)) + math.log(x[1] - x[0])
        out = {}
        for alpha in orders:
            log_moment = float(_logsumexp(alpha * loss + log_base, axis=0))
            out[float(alpha)] = max(log_moment, 0.0) / (alpha - 1)
        return out

    def _rdp_add(self, orders) -> list[float]:
        # D_α(P‖Q) = log E_P[exp(−(α−1)L(X))] / (α−1): the log-integrand
        # h(x) = −(α−1)L(x) − x²/2σ² is concave and at least as curved as N(0, σ²)'s.
        sigma, variance = self.noise_multiplier, self._variance
        c = np.asarray(orders, dtype=float) - 1.0  # (orders,)
        k = np.arange(self.group_size + 1, dtype=float)

        def slope(x):  # h'(x), decreasing in x
            terms = self._log_w + (2 * x[:, None] * k - k ** 2) / (2 * variance)
            post = np.exp(terms - _logsumexp(terms, axis=1)[:, None])
            return -c * (post @ k) / variance - x / variance

        lo, hi = -c * self.group_size - 1.0, np.zeros_like(c)
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            positive = slope(mid) > 0
            lo, hi = np.where(positive, mid, lo), np.where(positive, hi, mid)
            if np.all(hi - lo <= 1e-7 * sigma):
                break
        mode = 0.5 * (lo + hi)

        def log_integrand(x):  # (orders, points)
            return -c[:, None] * self.privacy_loss(x) - x ** 2 / (2 * variance)

        peak = log_integrand(mode[:, None])[:, 0]
        # Where h has dropped by 80 on either side (within 13σ of the mode by the curvature bound).
        ends = []
        for side in (-1.0, 1.0):
            near, far = mode.copy(), mode + side * 13.0 * sigma
            for _ in range(25):
                mid = 0.5 * (near + far)
                inside = log_integrand(mid[:, None])[:, 0] > peak - 80.0
                near, far = np.where(inside, mid, near), np.where(inside, far, mid)
            ends.append(far)
        grid = np.linspace(0.0, 1.0, 401)
        xs = ends[0][:, None] + (ends[1] - ends[0])[:, None] * grid  # (orders, points)
        values = log_integrand(xs)
        dx = (ends[1] - ends[0])
        # Trapezoid in log space; log of the N(0, σ²) normaliser.
        weights = np.full(grid.size, 1.0)
        weights[[0, -1]] = 0.5
        log_integral = _logsumexp(values + np.log(weights), axis=1) + np.log(dx / (grid.size - 1))
        log_moment = log_integral - math.log(sigma * math.sqrt(2 * math.pi))
        return [float(max(m, 0.0) / ci) for m, ci in zip(log_moment, c)]
