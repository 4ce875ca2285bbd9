"""hf_dp.accounting.composition: ε of a DP-SGD run, against dp-accounting, and how it moves with steps and noise."""
import pytest

from hf_dp import accounting
from pld_reference import DELTA, assert_matches_reference, reference_epsilon


# (q, σ, T, G, reference interval): q ∈ [1e-3, 0.5], σ ∈ [0.5, 10], T ≤ 1e4, G ≤ 32, ε ∈ [0.8, 25].
# dp-accounting's pessimistic rounding grows with T, so its long runs use a finer interval.
GRID = [
    pytest.param(0.01, 1.0, 1000, 1, 1e-3, id="q0.01-s1-T1e3"),
    pytest.param(0.5, 5.0, 100, 1, 1e-3, id="q0.5-s5-T100"),
    pytest.param(0.2, 0.5, 20, 1, 1e-3, id="q0.2-s0.5-T20"),
    pytest.param(0.5, 10.0, 1000, 1, 1e-3, id="q0.5-s10-T1e3"),
    pytest.param(0.01, 1.0, 10000, 1, 1e-4, id="q0.01-s1-T1e4"),
    pytest.param(0.1, 2.0, 100, 2, 1e-3, id="G2-q0.1-s2-T100"),
    pytest.param(0.01, 4.0, 1000, 32, 1e-3, id="G32-q0.01-s4-T1e3"),
    pytest.param(0.001, 0.8, 10000, 1, 1e-4, id="q1e-3-s0.8-T1e4", marks=pytest.mark.slow),
    pytest.param(0.01, 1.0, 1000, 4, 1e-3, id="G4-q0.01-s1-T1e3", marks=pytest.mark.slow),
    pytest.param(0.05, 3.0, 200, 8, 1e-3, id="G8-q0.05-s3-T200", marks=pytest.mark.slow),
    pytest.param(0.5, 10.0, 10, 16, 1e-3, id="G16-q0.5-s10-T10", marks=pytest.mark.slow),
    pytest.param(0.001, 2.0, 10000, 32, 1e-3, id="G32-q1e-3-s2-T1e4", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("sample_rate, noise_multiplier, steps, group_size, interval", GRID)
def test_epsilon_matches_dp_accounting(sample_rate, noise_multiplier, steps, group_size, interval):
    bounds = accounting.epsilon_bounds(sample_rate=sample_rate, noise_multiplier=noise_multiplier, steps=steps,
                                       delta=DELTA, group_size=group_size)
    reference = reference_epsilon([(sample_rate, noise_multiplier, group_size, steps)], interval=interval)
    assert_matches_reference(bounds, reference)
    assert accounting.epsilon(sample_rate=sample_rate, noise_multiplier=noise_multiplier, steps=steps,
                              delta=DELTA, group_size=group_size) == bounds[2]


def test_epsilon_grows_with_steps_and_shrinks_with_noise():
    values = [accounting.epsilon(sample_rate=0.02, noise_multiplier=1.0, steps=t, delta=DELTA) for t in (1, 10, 100)]
    assert 0 < values[0] < values[1] < values[2]
    assert accounting.epsilon(sample_rate=0.02, noise_multiplier=2.0, steps=100, delta=DELTA) < values[2]
    assert accounting.epsilon_bounds(sample_rate=0.02, noise_multiplier=1.0, steps=0, delta=DELTA) == (0, 0, 0)
