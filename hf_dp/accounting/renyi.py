"""Rényi divergences of one DP-SGD step's pair of distributions, per adjacency direction.

prv-accountant sizes its discretisation domain from them (it asks for exactly `RDP_ORDERS`);
[`~hf_dp.accounting.composition`] turns them into the RDP ε (a cheap upper bound that sizes the coarse
discretisation) and [`~hf_dp.accounting.group_privacy`] into the comparison's profile. The pair is
P = N(0, σ²) and Q = Σ_k w_k N(k, σ²), with privacy loss L = log Q/P ([`~hf_dp.accounting.mixture_loss`]):

- `"remove"`: D_α(Q‖P), exact at integer α from the moments E_P[(Q/P)^n] = Σ_s c_s e^{s²/2σ²}
  (c = the n-fold self-convolution of w_k e^{−k²/2σ²}), by quadrature at fractional α;
- `"add"`: D_α(P‖Q), by quadrature of the log-concave integrand P·(P/Q)^{α−1}.

Every value is an upper bound (+inf where it is not computed). Pure math: numpy only.
"""
from __future__ import annotations

import math

import numpy as np

from .mixture_loss import CHUNK, MixtureLoss, binomial_log_weights, log_sum_exp

__all__ = ["RDP_ORDERS", "add_divergences", "remove_divergences", "remove_divergences_fractional",
           "remove_divergences_integer"]

# prv-accountant's default RDP orders (prv_accountant.other_accountants.RDP): it asks for exactly
# these when it sizes the discretisation domain, so they are computed in one batch.
RDP_ORDERS = tuple([1.0 + x / 10.0 for x in range(1, 100)] + [float(a) for a in range(12, 64)])

# Largest sum of orders x G for the exact integer-order Rényi moments of the "remove" direction;
# higher orders report +inf (a valid, useless bound: prv-accountant then uses the lower orders).
_MAX_RDP_WORK = 4096


def remove_divergences(loss: MixtureLoss, orders) -> list[float]:
    """D_α(Q‖P) for each order α (0 at α ≤ 1; +inf at integer orders above the exact moments' reach)."""
    integers = sorted({int(a) for a in orders if float(a).is_integer() and a > 1})
    fractions = sorted({a for a in orders if not float(a).is_integer() and a > 1})
    values = {}
    values.update(remove_divergences_integer(loss, integers))
    values.update(remove_divergences_fractional(loss, fractions))
    return [values.get(float(a), math.inf) if a > 1 else values.get(float(a), 0.0) for a in orders]


def remove_divergences_integer(loss: MixtureLoss, orders) -> dict[float, float]:
    """Exact D_n(Q‖P) = log Σ_s c_s e^{s²/2σ²} / (n − 1), c = n-fold convolution of w_k e^{−k²/2σ²}."""
    if not orders:
        return {}
    group_size, variance = loss.group_size, loss.variance
    if group_size == 1:  # closed form (as TF Privacy): Σ_i C(n,i) q^i (1−q)^{n−i} e^{(i²−i)/2σ²}
        out = {}
        for n in orders:
            i = np.arange(n + 1, dtype=float)
            log_terms = binomial_log_weights(n, loss.sample_rate) + (i ** 2 - i) / (2 * variance)
            out[float(n)] = float(log_sum_exp(log_terms, axis=0)) / (n - 1)
        return out
    top = min(max(orders), max(2, _MAX_RDP_WORK // group_size))
    log_a = loss.log_weights - np.arange(group_size + 1) ** 2 / (2 * variance)
    out = {}
    coeffs = np.zeros(1)  # log c_s of the 0-fold convolution: c_0 = 1
    for n in range(1, top + 1):
        shifted = np.full((coeffs.size + group_size, group_size + 1), -np.inf)
        for k in range(group_size + 1):
            shifted[k:k + coeffs.size, k] = coeffs + log_a[k]
        coeffs = log_sum_exp(shifted, axis=1)
        if n in orders:
            s = np.arange(coeffs.size, dtype=float)
            out[float(n)] = float(log_sum_exp(coeffs + s ** 2 / (2 * variance), axis=0)) / (n - 1)
    return out


def remove_divergences_fractional(loss: MixtureLoss, orders) -> dict[float, float]:
    """D_α(Q‖P) = log ∫ N(x; 0, σ²) e^{αL(x)} dx / (α − 1) by quadrature on a fine grid.

    The integrand's modes lie in [0, αG] and are at least as wide as N(0, σ²); the grid
    spans 14σ beyond them with spacing σ/20.
    """
    if not orders:
        return {}
    sigma = loss.noise_multiplier
    lo, hi = -14.0 * sigma, max(orders) * loss.group_size + 14.0 * sigma
    points = min(400_001, int(math.ceil((hi - lo) / (sigma / 20.0))) + 1)
    x = np.linspace(lo, hi, points)
    values = np.concatenate([loss(x[i:i + CHUNK]) for i in range(0, points, CHUNK)])
    log_base = -x ** 2 / (2 * loss.variance) - math.log(sigma * math.sqrt(2 * math.pi)) + math.log(x[1] - x[0])
    out = {}
    for alpha in orders:
        log_moment = float(log_sum_exp(alpha * values + log_base, axis=0))
        out[float(alpha)] = max(log_moment, 0.0) / (alpha - 1)
    return out


def add_divergences(loss: MixtureLoss, orders) -> list[float]:
    """D_α(P‖Q) = log E_P[exp(−(α−1)L(X))] / (α−1) for each order α > 1, by quadrature.

    The log-integrand h(x) = −(α−1)L(x) − x²/2σ² is concave and at least as curved as N(0, σ²)'s:
    its mode is found by bisection on h', and the trapezoid rule runs where h is within 80 of its peak.
    """
    sigma, variance = loss.noise_multiplier, loss.variance
    c = np.asarray(orders, dtype=float) - 1.0  # (orders,)
    k = np.arange(loss.group_size + 1, dtype=float)

    def slope(x):  # h'(x), decreasing in x
        terms = loss.log_weights + (2 * x[:, None] * k - k ** 2) / (2 * variance)
        post = np.exp(terms - log_sum_exp(terms, axis=1)[:, None])
        return -c * (post @ k) / variance - x / variance

    lo, hi = -c * loss.group_size - 1.0, np.zeros_like(c)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        positive = slope(mid) > 0
        lo, hi = np.where(positive, mid, lo), np.where(positive, hi, mid)
        if np.all(hi - lo <= 1e-7 * sigma):
            break
    mode = 0.5 * (lo + hi)

    def log_integrand(x):  # (orders, points)
        return -c[:, None] * loss(x) - x ** 2 / (2 * variance)

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
    log_integral = log_sum_exp(values + np.log(weights), axis=1) + np.log(dx / (grid.size - 1))
    log_moment = log_integral - math.log(sigma * math.sqrt(2 * math.pi))
    return [float(max(m, 0.0) / ci) for m, ci in zip(log_moment, c)]
