"""The privacy loss function of one DP-SGD step, L(x), and its inverse.

One step's pair of distributions (see [`~hf_dp.accounting.privacy_loss`]) is P = N(0, σ²) and
Q = Σ_k w_k N(k, σ²) with w_k = Binom(k; G, q). Its privacy loss

    L(x) = log Q(x)/P(x) = log Σ_k w_k exp((2kx − k²)/2σ²)

is convex and increasing in x, so the distribution of the loss follows from inverting L. With
y = exp(x/σ²), L(x) = s reads Σ_{k≥1} w_k e^{-k²/2σ²} y^k = e^s − w_0, a polynomial with positive
coefficients: its log is convex in log y with slope in [1, G], and Newton's method from an upper
bound converges monotonically in a few steps.

Notation as in [`~hf_dp.accounting.privacy_loss`]: σ = `noise_multiplier`, q = `sample_rate`,
G = `group_size` (the `contribution_bound`). Pure math: numpy and scipy only.
"""
from __future__ import annotations

import math

import numpy as np
from scipy.special import gammaln

__all__ = ["CHUNK", "MixtureLoss", "binomial_log_weights", "log_sum_exp"]

# Points are processed in chunks so that the (points x components) work arrays stay small.
CHUNK = 1 << 15
# Sorted inputs: exact Newton on every this-many-th point, interpolation in between.
_ANCHOR_SPACING = 32


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


def log_sum_exp(values: np.ndarray, axis: int) -> np.ndarray:
    """log Σ exp along `axis`, −inf for all −inf rows, without warnings."""
    top = np.max(values, axis=axis, keepdims=True)
    safe_top = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        out = np.log(np.sum(np.exp(values - safe_top), axis=axis)) + np.squeeze(safe_top, axis=axis)
    return np.where(np.isfinite(np.squeeze(top, axis=axis)), out, np.squeeze(top, axis=axis))


class MixtureLoss:
    """L(x) = log Σ_k w_k exp((2kx − k²)/2σ²) with w_k = Binom(k; G, q), and its inverse.

    The arguments are those of [`~hf_dp.accounting.privacy_loss.MixtureOfGaussiansPRV`], which checks them.

    Args:
        sample_rate (`float`): q in (0, 1].
        noise_multiplier (`float`): σ > 0.
        group_size (`int`): G ≥ 1.

    Example:
        >>> loss = MixtureLoss(sample_rate=0.01, noise_multiplier=1.0, group_size=4)
        >>> loss.inverse(loss(1.5))  # L is increasing: the inverse recovers x
        array([1.5])
    """

    def __init__(self, sample_rate: float, noise_multiplier: float, group_size: int) -> None:
        self.sample_rate = float(sample_rate)
        self.noise_multiplier = float(noise_multiplier)
        self.variance = self.noise_multiplier ** 2
        self.group_size = int(group_size)
        self.log_weights = binomial_log_weights(self.group_size, self.sample_rate)  # (G+1,)
        self._log_w0 = float(self.log_weights[0])  # log(1-q)·G, −inf when q = 1
        # Newton coefficients for k ≥ 1: log a_k = log w_k − k²/2σ² (−inf for zero weights).
        k = np.arange(self.group_size + 1, dtype=float)
        positive = np.isfinite(self.log_weights[1:])
        self._newton_k = k[1:][positive]
        self._newton_log_a = (self.log_weights[1:] - k[1:] ** 2 / (2 * self.variance))[positive]
        self._newton_terms = list(zip(self._newton_k.tolist(), self._newton_log_a.tolist()))

    def __call__(self, x) -> np.ndarray:
        """L(x), elementwise."""
        x = np.asarray(x, dtype=float)
        k = np.arange(self.group_size + 1, dtype=float)
        terms = self.log_weights + (2 * x[..., None] * k - k ** 2) / (2 * self.variance)
        return log_sum_exp(terms, axis=-1)

    def inverse(self, loss) -> np.ndarray:
        """x with L(x) = `loss` (at least 1-d); −inf where `loss` ≤ log w_0 = G·log(1−q) (below L's range)."""
        loss = np.atleast_1d(np.asarray(loss, dtype=float))
        flat = loss.ravel()
        if self._newton_k.size == 1:  # G = 1 or q = 1: one term, φ is linear
            valid, log_r = self._log_r(flat)
            with np.errstate(invalid="ignore"):
                u = (log_r - self._newton_log_a[0]) / self._newton_k[0]
            return np.where(valid, self.variance * u, -np.inf).reshape(loss.shape)
        if flat.size >= 8 * _ANCHOR_SPACING:
            if np.all(flat[1:] >= flat[:-1]):
                return self._invert_sorted(flat).reshape(loss.shape)
            if np.all(flat[1:] <= flat[:-1]):
                return self._invert_sorted(flat[::-1])[::-1].reshape(loss.shape)
        out = np.empty_like(flat)
        for start in range(0, flat.size, CHUNK):
            out[start:start + CHUNK] = self._invert_chunk(flat[start:start + CHUNK])
        return out.reshape(loss.shape)

    def inverse_scalar(self, loss: float) -> float:
        """`inverse` for one point in plain Python (the same Newton iteration)."""
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
                return self.variance * u
        raise RuntimeError("inverting the privacy loss did not converge")  # pragma: no cover

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
        u_anchor = self._invert_chunk(loss[idx[anchors]]) / self.variance
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
        for start in range(0, idx.size, CHUNK):
            part = slice(start, start + CHUNK)
            first = max(0, np.searchsorted(anchors, start, side="right") - 1)
            last = min(anchors.size, np.searchsorted(anchors, start + CHUNK) + 1)
            relevant = np.any(weight_at_anchor[:, first:last] >= -45.0, axis=1)
            phi, slope = self._phi(u[part], k_all[relevant], log_a_all[relevant])
            step = (phi - v[part]) / slope
            u[part] -= step
            redo.append(np.flatnonzero(~(np.abs(step) <= 1e-9 * np.maximum(1.0, np.abs(u[part])))) + start)
        x[idx] = self.variance * u
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
        x[idx] = self.variance * u
        return x
