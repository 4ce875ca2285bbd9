"""Make `accounting_references.json`: independent ε references for `tests/accounting/test_accounting_references.py`.

Run from the repo root (about 30-60 min on 2 cores; the tests only read the committed JSON):

    python tests/reference/make_accounting_references.py            # all cases
    python tests/reference/make_accounting_references.py --only NAME  # recompute one case

References, none of them hf_dp code:
- G = 1: prv-accountant's stock `PRVAccountant` on its own `PoissonSubsampledGaussianMechanism`,
  whose certified interval [lower, upper] contains the true ε ("remove" direction, the larger
  one for the Poisson-subsampled Gaussian); dp-accounting's PLD (both directions, optimistic and
  pessimistic rounding) where the stock accountant fails or as a second opinion.
- G > 1: dp-accounting's PLD of the mixture of Gaussians (Binomial(G, q) sensitivities; its
  `MixtureOfGaussiansDpEvent`), both adjacency directions, pessimistic rounding (an upper bound)
  at discretisation interval h and 2h: |ε(2h) − ε(h)| estimates its discretisation error.
  (Its optimistic rounding returns 0 at these small q: no usable lower bound.)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from scipy.stats import binom

OUT = Path(__file__).with_name("accounting_references.json")

# (name, q, σ, T, G, δ). Dense where user-level DP lives: q ≤ 1e-3, σ ≤ 0.6, T ≥ 1e4.
CASES = [
    # the review's table
    ("q3e-4-s0.35-T1e5", 3e-4, 0.35, 100_000, 1, 1e-5),
    ("q1e-4-s0.35-T1e5", 1e-4, 0.35, 100_000, 1, 1e-5),
    ("q1e-4-s0.35-T3e4", 1e-4, 0.35, 30_000, 1, 1e-5),
    ("q1e-3-s0.35-T3e4", 1e-3, 0.35, 30_000, 1, 1e-5),
    ("q1e-4-s0.4-T1e4", 1e-4, 0.4, 10_000, 1, 1e-5),
    ("q1e-4-s0.4-T1e5", 1e-4, 0.4, 100_000, 1, 1e-5),
    ("q1e-4-s0.383-T3e4", 1e-4, 0.383, 30_000, 1, 1.5625e-7),  # 640k users, batch 64, 3 epochs
    # the many-users corner
    ("q1e-5-s0.3-T1e5", 1e-5, 0.3, 100_000, 1, 1e-6),
    ("q1e-5-s0.5-T1e5", 1e-5, 0.5, 100_000, 1, 1e-6),
    ("q3e-5-s0.4-T1e5", 3e-5, 0.4, 100_000, 1, 1e-6),
    ("q3e-5-s0.6-T3e4", 3e-5, 0.6, 30_000, 1, 1e-6),
    ("q1e-4-s0.3-T1e4", 1e-4, 0.3, 10_000, 1, 1e-5),
    ("q1e-4-s0.5-T3e4", 1e-4, 0.5, 30_000, 1, 1e-5),
    ("q1e-4-s0.6-T1e5", 1e-4, 0.6, 100_000, 1, 1e-5),
    ("q3e-4-s0.45-T3e4", 3e-4, 0.45, 30_000, 1, 1e-5),
    ("q3e-4-s0.6-T1e4", 3e-4, 0.6, 10_000, 1, 1e-5),
    ("q1e-3-s0.5-T1e4", 1e-3, 0.5, 10_000, 1, 1e-5),
    ("q1e-3-s0.6-T1e5", 1e-3, 0.6, 100_000, 1, 1e-5),
    ("q1e-3-s0.4-T1e4-d1e-12", 1e-3, 0.4, 10_000, 1, 1e-12),
    ("q1e-4-s0.5-T1e4-d1e-3", 1e-4, 0.5, 10_000, 1, 1e-3),
    ("q1e-6-s0.3-T1e6", 1e-6, 0.3, 1_000_000, 1, 1e-7),
    ("q1e-5-s0.6-T1e6", 1e-5, 0.6, 1_000_000, 1, 1e-7),
    # the rest of the domain
    ("q1e-2-s1-T1e3", 0.01, 1.0, 1000, 1, 1e-5),
    ("q0.5-s5-T100", 0.5, 5.0, 100, 1, 1e-5),
    ("q0.2-s0.5-T20", 0.2, 0.5, 20, 1, 1e-5),
    ("q1-s100-T1e4", 1.0, 100.0, 10_000, 1, 1e-5),
    ("q1-s2-T1", 1.0, 2.0, 1, 1, 1e-5),
    ("q1-s0.8-T10", 1.0, 0.8, 10, 1, 1e-5),
    ("q0.05-s0.7-T500", 0.05, 0.7, 500, 1, 1e-5),
    ("q1e-2-s10-T1e5-d1e-12", 0.01, 10.0, 100_000, 1, 1e-12),
    ("q0.01-s0.3-T1", 0.01, 0.3, 1, 1, 1e-5),
    # ELS, G > 1 (mixture of Gaussians)
    ("G4-q3e-5-s0.5-T1e5", 3e-5, 0.5, 100_000, 4, 1e-5),
    ("G2-q1e-4-s0.4-T3e4", 1e-4, 0.4, 30_000, 2, 1e-5),
    ("G8-q1e-4-s0.6-T1e4", 1e-4, 0.6, 10_000, 8, 1e-5),
    ("G16-q1e-5-s0.5-T1e5", 1e-5, 0.5, 100_000, 16, 1e-6),
    ("G32-q1e-3-s2-T1e4", 1e-3, 2.0, 10_000, 32, 1e-5),
    ("G4-q1e-3-s0.6-T1e4", 1e-3, 0.6, 10_000, 4, 1e-5),
    ("G64-q1e-4-s1-T1e4", 1e-4, 1.0, 10_000, 64, 1e-6),
    ("G256-q1e-5-s1-T1e4", 1e-5, 1.0, 10_000, 256, 1e-6),
    ("G256-q0.01-s30-T1e3", 0.01, 30.0, 1000, 256, 1e-5),
    ("G32-q0.01-s4-T1e3", 0.01, 4.0, 1000, 32, 1e-5),
    ("G4-q0.01-s1-T1e3", 0.01, 1.0, 1000, 4, 1e-5),
    ("G16-q0.5-s10-T10", 0.5, 10.0, 10, 16, 1e-5),
    ("G8-q0.05-s3-T200-d1e-12", 0.05, 3.0, 200, 8, 1e-12),
]

# Ledgers whose q, σ or G change mid-run: (name, [(q, σ, G, T), ...], δ).
SEGMENT_CASES = [
    ("segments-q-s-change", [(1e-4, 0.5, 1, 20_000), (2e-4, 0.4, 1, 10_000), (1e-4, 0.6, 1, 30_000)], 1e-5),
    ("segments-G-change", [(1e-4, 0.6, 1, 5_000), (1e-4, 0.6, 4, 5_000)], 1e-5),
]


def stock_prv(segments, delta, eps_error=0.01):
    from prv_accountant import PRVAccountant
    from prv_accountant.privacy_random_variables import PoissonSubsampledGaussianMechanism

    prvs = [PoissonSubsampledGaussianMechanism(q, sigma) for q, sigma, _, _ in segments]
    counts = [steps for *_, steps in segments]
    accountant = PRVAccountant(prvs, eps_error=eps_error, delta_error=delta / 1000, max_self_compositions=counts)
    lower, estimate, upper = accountant.compute_epsilon(delta, counts)
    return {"lower": lower, "estimate": estimate, "upper": upper, "eps_error": eps_error}


def _pld_of(segments, interval):
    from dp_accounting.pld import privacy_loss_distribution as pld_module

    total = None
    for q, sigma, group, steps in segments:
        if group == 1:
            dist = pld_module.from_gaussian_mechanism(sigma, sampling_prob=q, value_discretization_interval=interval)
        else:
            k = np.arange(group + 1)
            weights = binom.pmf(k, group, q)
            keep = weights > 0
            dist = pld_module.from_mixture_gaussian_mechanism(
                sigma, k[keep].astype(float).tolist(), weights[keep].tolist(), value_discretization_interval=interval)
        dist = dist.self_compose(steps)
        total = dist if total is None else total.compose(dist)
    return total


def pld(segments, delta, interval):
    out = {"interval": interval}
    for name, h in (("pessimistic", interval), ("pessimistic_2h", 2 * interval)):
        out[name] = _pld_of(segments, h).get_epsilon_for_delta(delta)
    out["discretisation_error"] = abs(out["pessimistic_2h"] - out["pessimistic"])
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="case names to (re)compute")
    args = parser.parse_args(argv)
    results = json.loads(OUT.read_text()) if OUT.exists() else {}
    cases = [(name, [(q, sigma, group, steps)], delta) for name, q, sigma, steps, group, delta in CASES]
    for name, segments, delta in cases + SEGMENT_CASES:
        if args.only and name not in args.only or not args.only and name in results:
            continue
        record = {"segments": [dict(zip(("sample_rate", "noise_multiplier", "group_size", "steps"), s))
                               for s in segments], "delta": delta}
        start = time.time()
        steps = sum(s[3] for s in segments)
        if all(s[2] == 1 for s in segments):
            try:
                record["prv_accountant"] = stock_prv(segments, delta)
            except Exception as error:  # noqa: BLE001 - recorded: the PLD reference is used instead
                record["prv_accountant_error"] = f"{type(error).__name__}: {error}"
        if "prv_accountant" not in record:
            interval = 1e-3 if steps <= 1000 else 1e-4 if steps <= 100_000 else 2e-4
            try:
                record["dp_accounting"] = pld(segments, delta, interval)
            except Exception as error:  # noqa: BLE001
                record["dp_accounting_error"] = f"{type(error).__name__}: {error}"
        record["seconds"] = round(time.time() - start, 1)
        results[name] = record
        OUT.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        print(name, json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
