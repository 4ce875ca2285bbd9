"""Speed of hf_dp.accounting where user-level DP lives: one ε, one calibration, one ledger step.

Every timing is a cold call: the accountant's cache (`hf_dp.accounting.CACHE`) is cleared first,
so it includes building the discretisation. Targets on the 2-core machine: one ε for 1e5 steps
under 1 s; a calibration under 2 s at G = 1 and under 5 s at G = 32.

    python benchmarks/accounting_speed.py [--delta 1e-5]
"""
from __future__ import annotations

import argparse
import time

from hf_dp import accounting

# (q, σ, G, T): many users (q ≤ 1e-3, σ ≤ 0.6, T ≥ 1e4), ELS up to G = 32, and a small run.
SETTINGS = [
    (1e-4, 0.4, 1, 100_000),
    (1e-5, 0.5, 1, 100_000),
    (1e-3, 0.6, 1, 10_000),
    (3e-4, 0.35, 1, 30_000),
    (3e-5, 0.5, 4, 100_000),
    (1e-4, 0.6, 32, 10_000),
    (1e-3, 2.0, 32, 10_000),
    (0.01, 1.0, 1, 1_000),
]


def _timed(fn):
    accounting.CACHE.clear()
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def _ledger_step_time(q: float, sigma: float, group: int, steps: int, delta: float, probes: int = 20) -> float:
    """Mean time of epsilon_after(δ, steps=1) for an accountant whose ledger gains one step per call, near `steps`."""
    accounting.CACHE.clear()
    accountant = accounting.PrivacyAccountant()
    accountant.step(sample_rate=q, noise_multiplier=sigma, group_size=group, steps=steps - probes)
    accountant.epsilon_after(delta, steps=1)  # builds the discretisation for this horizon
    start = time.perf_counter()
    for _ in range(probes - 1):
        accountant.step(sample_rate=q, noise_multiplier=sigma, group_size=group)
        accountant.epsilon_after(delta, steps=1)
    return (time.perf_counter() - start) / (probes - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delta", type=float, default=1e-5)
    args = parser.parse_args()
    delta = args.delta
    accounting.epsilon(sample_rate=0.01, noise_multiplier=1.0, steps=10, delta=delta)  # imports, FFT plans

    header = ["q", "σ", "G", "T", "ε (upper)", "±", "epsilon s", "σ for 0.8ε", "calibrate s", "ledger step ms"]
    rows = []
    for q, sigma, group, steps in SETTINGS:
        bounds, t_eps = _timed(lambda: accounting.epsilon_bounds(
            sample_rate=q, noise_multiplier=sigma, steps=steps, delta=delta, group_size=group))
        target = 0.8 * bounds[2]
        calibrated, t_cal = _timed(lambda: accounting.noise_multiplier(
            target_epsilon=target, delta=delta, sample_rate=q, steps=steps, group_size=group))
        t_step = _ledger_step_time(q, sigma, group, steps, delta)
        row = [f"{q:g}", f"{sigma:g}", str(group), f"{steps:g}", f"{bounds[2]:.4f}", f"{bounds[2] - bounds[1]:.4f}",
               f"{t_eps:.2f}", f"{calibrated:.4f}", f"{t_cal:.2f}", f"{1000 * t_step:.1f}"]
        rows.append(row)
        print("  done:", " ".join(row), flush=True)

    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print(f"\nhf_dp.accounting, δ = {delta:g} (cold calls; '±' = upper bound − estimate)")
    for i, r in enumerate([header, *rows]):
        print("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


if __name__ == "__main__":
    main()
