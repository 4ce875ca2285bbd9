"""Speed (and accuracy) of hf_dp.accounting: one ε, one calibration, one ledger step.

Every timing is a cold call: the accountant's caches are cleared first, so it includes
building the discretisation. Pass --reference to also time Google's dp-accounting PLD
accountant on the same settings and print the relative difference of the two ε.

    python benchmarks/accounting_speed.py [--reference] [--steps 10000] [--delta 1e-5]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from hf_dp import accounting
from hf_dp.accounting import accountant as _accountant

# (q, σ, G): example-level/ULS settings and ELS settings with G up to 32.
SETTINGS = [
    (0.01, 1.0, 1),
    (0.001, 0.8, 1),
    (0.1, 2.0, 1),
    (0.001, 2.0, 32),
    (0.01, 4.0, 32),
    (0.005, 1.5, 8),
]


def _cold() -> None:
    for cache in (_accountant._RESULTS, _accountant._ACCOUNTANTS, _accountant._EPS_ERRORS, _accountant._COARSE):
        cache.clear()
    _accountant._mechanism.cache_clear()


def _timed(fn):
    _cold()
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def _reference(q: float, sigma: float, group: int, steps: int, delta: float):
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant
    from scipy import stats

    if group == 1:
        event = dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma))
    else:
        k = np.arange(group + 1)
        event = dp_event.MixtureOfGaussiansDpEvent(sigma, [float(x) for x in k],
                                                   [float(p) for p in stats.binom.pmf(k, group, q)])
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4 if group == 1 else 1e-3)
    acc.compose(event, steps)
    return acc.get_epsilon(delta)


def _ledger_step_time(q: float, sigma: float, group: int, steps: int, delta: float, probes: int = 50) -> float:
    """Mean time of epsilon_after(δ, steps=1) in a ledger that takes one step per call, near `steps`."""
    _cold()
    ledger = accounting.PrivacyAccountant()
    ledger.step(sample_rate=q, noise_multiplier=sigma, group_size=group, steps=steps - probes)
    ledger.epsilon_after(delta, steps=1)  # builds the discretisation for this horizon
    start = time.perf_counter()
    for _ in range(probes - 1):
        ledger.step(sample_rate=q, noise_multiplier=sigma, group_size=group)
        ledger.epsilon_after(delta, steps=1)
    return (time.perf_counter() - start) / (probes - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--reference", action="store_true", help="also run dp-accounting's PLD accountant")
    args = parser.parse_args()
    steps, delta = args.steps, args.delta
    accounting.epsilon(sample_rate=0.01, noise_multiplier=1.0, steps=10, delta=delta)  # imports, FFT plans

    header = ["q", "σ", "G", "ε (upper)", "±", "epsilon s", "σ for 0.8ε", "calibrate s", "ledger step ms"]
    if args.reference:
        header += ["dp-accounting ε", "rel. diff", "dp-acc s"]
    rows = []
    for q, sigma, group in SETTINGS:
        bounds, t_eps = _timed(lambda: accounting.epsilon_bounds(
            sample_rate=q, noise_multiplier=sigma, steps=steps, delta=delta, group_size=group))
        target = 0.8 * bounds[2]
        calibrated, t_cal = _timed(lambda: accounting.noise_multiplier(
            target_epsilon=target, delta=delta, sample_rate=q, steps=steps, group_size=group))
        t_step = _ledger_step_time(q, sigma, group, steps, delta)
        row = [f"{q:g}", f"{sigma:g}", str(group), f"{bounds[2]:.4f}", f"{bounds[2] - bounds[1]:.4f}",
               f"{t_eps:.2f}", f"{calibrated:.4f}", f"{t_cal:.2f}", f"{1000 * t_step:.1f}"]
        if args.reference:
            start = time.perf_counter()
            reference = _reference(q, sigma, group, steps, delta)
            t_ref = time.perf_counter() - start
            row += [f"{reference:.4f}", f"{100 * (bounds[2] / reference - 1):+.2f}%", f"{t_ref:.2f}"]
        rows.append(row)
        print("  done:", " ".join(row), flush=True)

    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print(f"\nhf_dp.accounting, {steps} steps, δ = {delta:g} (cold calls; '±' = upper bound − estimate)")
    for i, r in enumerate([header, *rows]):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))


if __name__ == "__main__":
    main()
