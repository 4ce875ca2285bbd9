"""Lower bounds on ε from one training run (the statistics of a one-run privacy audit).

The audit: m canary users are each included in training by an independent fair coin; after the
run, an auditor scores every canary (higher = "looks trained on"), guesses "in" for the k+ best
scored, "out" for the k- worst, abstains on the rest, and counts its correct guesses. A
training algorithm that is (ε, δ)-DP with respect to one user cannot make many correct guesses likely, so
a large count refutes every ε below some value, with a stated confidence. That value is the
empirical lower bound. It says "the guarantee is no better than this"; it never certifies one.

Two estimators:

- `epsilon_lower_bound`: Steinke, Nasr & Jagielski 2023, "Privacy auditing with one (1) training
  run" (arXiv 2305.08846). For δ = 0 it is Theorem 3.1 (the correct guesses are stochastically
  dominated by Binomial(r, e^ε / (1 + e^ε))); for δ > 0 it is the paper's approximate-DP
  extension, P[W ≥ v] ≤ β + 2·m·δ·α with β the binomial tail and α = max_i P[v - i ≤ W' < v] / i,
  computed exactly as the authors' own code listing (`p_value_DP_audit`) does.
- `fdp_epsilon_lower_bound`: Mahloujifar, Melis & Chaudhuri 2024, "Auditing f-differential
  privacy in one run" (arXiv 2410.22235), the recursion of their audit with abstentions
  (``audit_rh_with_cap``, alphabet size 2) for the Gaussian trade-off curve: it refutes μ-GDP for
  every μ below a bound and converts that μ to ε at the given δ. Tighter, but only a bound on ε *for
  algorithms whose trade-off curve is Gaussian* (as DP-SGD's is, approximately): the assumption is part
  of the claim.

Choosing (k+, k-) after seeing the scores is a multiple test. When several pairs are tried we
apply a union (Bonferroni) bound: each pair is tested at level (1 - confidence) / (pairs tried),
so the reported maximum holds with the stated confidence. The papers report the best pair over a
search without that correction; ours is slightly more conservative and honest.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import numpy as np
from scipy import optimize, special, stats

__all__ = ["AuditResult", "audit_guesses", "default_guess_grid", "epsilon_lower_bound", "fdp_epsilon_lower_bound"]

STEINKE = "steinke-nasr-jagielski-2023"
MAHLOUJIFAR_GDP = "mahloujifar-melis-chaudhuri-2024-gaussian"

_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.25, 0.5)
_TOLERANCE = 1e-6
_MAX_PARAMETER = 1e3


@dataclasses.dataclass(frozen=True)
class AuditResult:
    """The outcome of one audit.

    Attributes:
        epsilon_lower_bound: ε refuted by the audit: with probability at least `confidence`, the
            run is not (ε', δ)-DP for any ε' below it (0 when nothing is refuted).
        delta: The δ of the audited guarantee.
        confidence: The overall confidence, already corrected for the pairs tried.
        canaries: Number of canaries m.
        included: How many canaries were included in training.
        guesses: (k_plus, k_minus) of the pair that gave the bound.
        correct: Correct guesses out of k_plus + k_minus for that pair.
        method: Which estimator produced the bound.
        hypotheses: Number of (k_plus, k_minus) pairs tried (the union-bound factor).
        mu_lower_bound: For the Gaussian f-DP estimator, the refuted μ (μ-GDP); else None.
    """

    epsilon_lower_bound: float
    delta: float
    confidence: float
    canaries: int
    included: int
    guesses: tuple[int, int]
    correct: int
    method: str
    hypotheses: int = 1
    mu_lower_bound: float | None = None

    def to_dict(self) -> dict:
        """A JSON-ready dict (plain Python numbers; `guesses` as a list)."""
        out = dataclasses.asdict(self)
        out["guesses"] = list(self.guesses)
        return out


def default_guess_grid(num_canaries: int) -> list[tuple[int, int]]:
    """The (k_plus, k_minus) pairs searched when no guesses are given.

    Each of k_plus, k_minus is 0 or 1, 2, 5, 10, 25 or 50 % of the canaries (at least 1), every
    combination with 1 ≤ k_plus + k_minus ≤ m. Small fractions pay off when only a few canaries
    are memorised; large ones when the signal is weak but spread over all canaries.

    Args:
        num_canaries: Number of canaries m (at least 1).

    Returns:
        The pairs, sorted.
    """
    sizes = sorted({0} | {max(1, round(f * num_canaries)) for f in _FRACTIONS})
    return [(kp, km) for kp in sizes for km in sizes if 1 <= kp + km <= num_canaries]


def epsilon_lower_bound(
    scores: Sequence[float],
    included: Sequence[bool],
    *,
    delta: float,
    confidence: float = 0.95,
    guesses: tuple[int, int] | Sequence[tuple[int, int]] | None = None,
) -> AuditResult:
    """Steinke, Nasr & Jagielski's (2023) one-run lower bound on ε.

    For each (k+, k-) pair, the auditor guesses "in" for the k+ highest scores and "out" for the
    k- lowest (ties broken by canary order, which is independent of the coins), counts v correct
    guesses out of r = k+ + k-, and finds by bisection the largest ε whose p-value for "at least v
    correct" is below (1 - confidence) / pairs. The p-value is the paper's: for δ = 0 the tail of
    Binomial(r, e^ε/(1+e^ε)) (Theorem 3.1); for δ > 0 that tail plus 2·m·δ·α (its approximate-DP
    bound, as in the authors' code).

    Args:
        scores: One score per canary; higher means more likely included.
        included: The inclusion coin of each canary (True = trained on).
        delta: δ of the audited guarantee, in [0, 1).
        confidence: Probability that the bound is valid, in (0, 1).
        guesses: One (k_plus, k_minus) pair, several, or None for `default_guess_grid`. With more
            than one pair the confidence is split among them (union bound).

    Returns:
        `AuditResult` of the pair that gives the largest bound.

    Raises:
        ValueError: If an argument is out of range or scores and inclusion do not match.
    """
    return _audit(scores, included, delta, confidence, guesses, method=STEINKE)


def fdp_epsilon_lower_bound(
    scores: Sequence[float],
    included: Sequence[bool],
    *,
    delta: float,
    confidence: float = 0.95,
    guesses: tuple[int, int] | Sequence[tuple[int, int]] | None = None,
) -> AuditResult:
    """Mahloujifar, Melis & Chaudhuri's (2024) one-run bound, for the Gaussian trade-off curve.

    Same guessing game as `epsilon_lower_bound`. For a hypothesised μ-GDP curve, the recursion of
    their audit with abstentions (``audit_rh_with_cap``, alphabet size 2) decides whether v or more correct
    guesses out of r have probability below τ = (1 - confidence) / pairs; bisection finds the
    largest refuted μ (refutation is monotone in μ), which is converted to the ε of μ-GDP at
    `delta` (Dong, Roth & Su 2019, Corollary 2.13). The result bounds ε only for algorithms
    whose privacy is described by a Gaussian trade-off curve, e.g. one Gaussian release and,
    approximately, DP-SGD.

    Args:
        scores: One score per canary; higher means more likely included.
        included: The inclusion coin of each canary (True = trained on).
        delta: δ used to express the refuted μ as ε, in (0, 1).
        confidence: Probability that the bound is valid, in (0, 1).
        guesses: One (k_plus, k_minus) pair, several, or None for `default_guess_grid`.

    Returns:
        `AuditResult` with `mu_lower_bound` set.

    Raises:
        ValueError: If an argument is out of range (including delta = 0: every μ > 0 has ε = ∞
            at δ = 0) or scores and inclusion do not match.
    """
    if isinstance(delta, (int, float)) and delta == 0:
        raise ValueError(
            "delta must be > 0 for fdp_epsilon_lower_bound (μ-GDP has no finite ε at δ = 0); "
            "pass the δ of the guarantee, e.g. 1e-5."
        )
    return _audit(scores, included, delta, confidence, guesses, method=MAHLOUJIFAR_GDP)


def steinke_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Upper bound on P[at least v of r guesses correct] under (ε, δ)-DP (Steinke et al. 2023).

    Args:
        m: Number of canaries.
        r: Number of guesses (non-abstentions).
        v: Number of correct guesses observed.
        epsilon: ε of the null hypothesis.
        delta: δ of the null hypothesis.

    Returns:
        The p-value, in [0, 1].
    """
    q = float(special.expit(epsilon))  # accuracy of ε-DP randomized response
    beta = float(stats.binom.sf(v - 1, r, q))  # P[Binomial(r, q) ≥ v]
    if delta == 0 or v == 0:
        return beta
    i = np.arange(1, v + 1)
    below = stats.binom.cdf(v - 1, r, q) - stats.binom.cdf(v - 1 - i, r, q)  # P[v-i ≤ W' < v]
    alpha = max(0.0, float(np.max(below / i)))
    return min(1.0, beta + alpha * delta * 2 * m)


def gdp_rejects(mu: float, m: int, r: int, v: int, tau: float) -> bool:
    """Whether v correct guesses out of r (m canaries) refute μ-GDP at level τ.

    The recursion of Mahloujifar et al. (2024) for guessing with abstentions (``audit_rh_with_cap``),
    alphabet size 2, Gaussian curve, whose inverse blow-up is x ↦ Φ(Φ⁻¹(x) - μ). Both sequences only grow
    as i decreases, so the loop stops as soon as the answer is known.

    Args:
        mu: μ of the hypothesised μ-GDP curve (≥ 0).
        m: Number of canaries.
        r: Number of guesses.
        v: Number of correct guesses.
        tau: Level of the test.

    Returns:
        True if P[at least v correct] < τ for every μ-GDP algorithm, i.e. μ is refuted.
    """
    target = r / m
    rr, h = tau * v / m, tau * (r - v) / m
    for i in range(v - 1, -1, -1):
        if rr + h > target:
            return True
        h_new = max(h, float(special.ndtr(special.ndtri(rr) - mu)))
        if h_new == h:  # nothing changes from here on
            break
        rr, h = rr + i / (r - i) * (h_new - h), h_new
    return rr + h > target


def gdp_epsilon(mu: float, delta: float) -> float:
    """The smallest ε such that μ-GDP implies (ε, δ)-DP (Dong, Roth & Su 2019, Corollary 2.13).

    Solves Φ(-ε/μ + μ/2) - e^ε Φ(-ε/μ - μ/2) = δ in log space.

    Args:
        mu: μ ≥ 0.
        delta: δ in (0, 1).

    Returns:
        ε ≥ 0.
    """
    if mu <= 0:
        return 0.0

    def log_gap(eps: float) -> float:
        log_a = special.log_ndtr(-eps / mu + mu / 2)
        log_b = eps + special.log_ndtr(-eps / mu - mu / 2)
        if log_b >= log_a:  # δ(ε) underflowed to 0: far below any δ of interest
            return -1e3
        return float(log_a + np.log1p(-np.exp(log_b - log_a)) - math.log(delta))

    if log_gap(0.0) <= 0:
        return 0.0
    hi = 1.0
    while log_gap(hi) > 0:
        hi *= 2
    return float(optimize.brentq(log_gap, 0.0, hi, xtol=1e-10))


def _audit(scores, included, delta, confidence, guesses, *, method: str) -> AuditResult:
    scores, included = _check(scores, included, delta, confidence)
    m = len(scores)
    pairs = _pairs(guesses, m)
    significance = (1 - confidence) / len(pairs)

    # Sort once: correct(k+, k-) = included among the top k+ + excluded among the bottom k-.
    order = np.argsort(-scores, kind="stable")
    ranked = included[order]
    in_top = np.concatenate([[0], np.cumsum(ranked)])
    out_bottom = np.concatenate([[0], np.cumsum(~ranked[::-1])])

    if method == STEINKE:
        def refutes(value: float, r: int, v: int) -> bool:
            return steinke_p_value(m, r, v, value, delta) < significance
    else:
        def refutes(value: float, r: int, v: int) -> bool:
            return gdp_rejects(value, m, r, v, significance)

    # Search pairs in order of raw precision; a pair that cannot beat the best so far is skipped.
    counts = [(kp, km, int(in_top[kp] + out_bottom[km])) for kp, km in pairs]
    counts.sort(key=lambda c: -c[2] / (c[0] + c[1]))
    best, best_pair = 0.0, counts[0]
    for kp, km, v in counts:
        r = kp + km
        if 2 * v <= r or not refutes(best, r, v):
            continue
        value = _largest_refuted(lambda x: refutes(x, r, v), start=best)
        if value > best:
            best, best_pair = value, (kp, km, v)

    kp, km, v = best_pair
    mu = None
    epsilon = best
    if method == MAHLOUJIFAR_GDP:
        mu, epsilon = best, gdp_epsilon(best, delta)
    return AuditResult(
        epsilon_lower_bound=float(epsilon),
        delta=float(delta),
        confidence=float(confidence),
        canaries=m,
        included=int(included.sum()),
        guesses=(int(kp), int(km)),
        correct=int(v),
        method=method,
        hypotheses=len(pairs),
        mu_lower_bound=None if mu is None else float(mu),
    )


def _largest_refuted(refutes: Callable[[float], bool], *, start: float) -> float:
    """Bisection for the sup of refuted values, given that `start` is refuted.

    Any refuted value is a valid report (an (ε, δ)-DP algorithm is (ε', δ)-DP for all ε' ≥ ε),
    so the invariant "lo is refuted" is all that validity needs.
    """
    lo, hi = start, max(1.0, 2 * start)
    while refutes(hi):
        lo, hi = hi, 2 * hi
        if hi > _MAX_PARAMETER:
            return lo
    while hi - lo > _TOLERANCE * max(1.0, lo):
        mid = (lo + hi) / 2
        if refutes(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _check(scores, included, delta, confidence) -> tuple[np.ndarray, np.ndarray]:
    scores = np.asarray(scores, dtype=float).reshape(-1)
    raw = np.asarray(included).reshape(-1)
    if len(scores) != len(raw):
        raise ValueError(
            f"scores and included must have the same length (got {len(scores)} and {len(raw)}); "
            "pass one score and one inclusion bit per canary."
        )
    if len(scores) < 2:
        raise ValueError(f"at least 2 canaries are needed (got {len(scores)}); audit with more canaries.")
    if not np.all(np.isfinite(scores)):
        raise ValueError("scores must be finite (found NaN or inf); drop or fix the canaries whose score failed.")
    if raw.dtype != bool and not np.all((raw == 0) | (raw == 1)):
        raise ValueError("included must hold booleans or 0/1; pass the inclusion record of the canaries.")
    if not (isinstance(delta, (int, float, np.floating)) and 0 <= delta < 1):
        raise ValueError(f"delta must be in [0, 1) (got {delta!r}); pass the δ of the audited guarantee, e.g. 1e-5.")
    if not (isinstance(confidence, (int, float, np.floating)) and 0 < confidence < 1):
        raise ValueError(f"confidence must be in (0, 1) (got {confidence!r}); pass e.g. 0.95.")
    return scores, raw.astype(bool)


def _pairs(guesses, m: int) -> list[tuple[int, int]]:
    if guesses is None:
        return default_guess_grid(m)
    single = len(guesses) == 2 and all(isinstance(k, (int, np.integer)) for k in guesses)
    pairs = [tuple(guesses)] if single else [tuple(g) for g in guesses]
    if not pairs:
        raise ValueError("guesses must not be empty; pass (k_plus, k_minus), a list of them, or None.")
    for pair in pairs:
        ok = len(pair) == 2 and all(isinstance(k, (int, np.integer)) and k >= 0 for k in pair)
        if not ok or not 1 <= pair[0] + pair[1] <= m:
            raise ValueError(
                f"guesses must be (k_plus, k_minus) with non-negative ints and 1 <= k_plus + k_minus <= {m} "
                f"(got {pair!r}); lower the counts or pass None to search the default grid."
            )
    return [(int(kp), int(km)) for kp, km in pairs]


def audit_guesses(num_canaries: int) -> list[tuple[int, int]]:
    """The (k_plus, k_minus) guess counts an audit tries: (k, k) for k = 5, 10, 25 and 50 % of the canaries and
    (k, 0) for k = 2, 5, 10, 20 and 25 % (at least 1 each).

    Few pairs, because the confidence is split among them (union bound) and, at δ > 0, Steinke et al.'s p-value
    carries a floor of about 2·m·δ·α: with the 48 pairs of [`default_guess_grid`] a run's δ near 1e-4 leaves no
    room below the split level and the audit can show nothing (its ceiling falls to 0 at m = 256, δ = 3e-4, against
    2.1 with these 7). Symmetric guesses serve signals spread over all canaries, "in"-only guesses a few
    memorised ones; on simulated Gaussian and randomized-response scores these pairs match or beat the 48. The
    20 and 25 % "in" guesses serve memorised canaries that are many but not all perfectly ranked: with 512
    canaries, 98 right of 102 "in" refutes ε = 2.0 at δ = 1e-5, where the best of the other 7 pairs gave 1.6.

    Args:
        num_canaries: m, at least 2.

    Returns:
        The pairs, sorted.
    """
    pairs = {(max(1, round(f * num_canaries)),) * 2 for f in (0.05, 0.1, 0.25, 0.5)}
    pairs |= {(max(1, round(f * num_canaries)), 0) for f in (0.02, 0.05, 0.1, 0.2, 0.25)}
    return sorted(p for p in pairs if sum(p) <= num_canaries)
