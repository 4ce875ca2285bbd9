"""hf_dp.accounting.calibration: the smallest noise multiplier that meets a target ε."""
import pytest

from hf_dp import accounting
from hf_dp.accounting import PrivacyAccountant, calibration
from pld_reference import DELTA


def test_noise_multiplier_inverts_epsilon():
    for group_size, sample_rate, steps, target in [(1, 0.01, 1000, 2.0), (8, 0.01, 300, 4.0)]:
        sigma = accounting.noise_multiplier(target_epsilon=target, delta=DELTA, sample_rate=sample_rate,
                                            steps=steps, group_size=group_size)
        spent = accounting.epsilon(sample_rate=sample_rate, noise_multiplier=sigma, steps=steps, delta=DELTA,
                                   group_size=group_size)
        assert spent <= target
        smaller = sigma / (1 + calibration.NOISE_MULTIPLIER_RTOL)
        assert accounting.epsilon(sample_rate=sample_rate, noise_multiplier=smaller, steps=steps, delta=DELTA,
                                  group_size=group_size) > target
        # the ledger of that run stays within the target too
        ledger = PrivacyAccountant()
        ledger.step(sample_rate=sample_rate, noise_multiplier=sigma, group_size=group_size, steps=steps)
        assert ledger.epsilon(DELTA) == spent


def test_noise_multiplier_unreachable_target_says_what_to_change():
    with pytest.raises(ValueError, match="raise the target"):
        accounting.noise_multiplier(target_epsilon=1e-4, delta=DELTA, sample_rate=0.5, steps=10000)


def test_noise_multiplier_rejects_bad_target():
    for target in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="target_epsilon"):
            accounting.noise_multiplier(target_epsilon=target, delta=DELTA, sample_rate=0.01, steps=10)
