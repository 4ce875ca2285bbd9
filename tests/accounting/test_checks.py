"""hf_dp.accounting.checks: every accounting entry point refuses an argument outside its domain, naming it."""
import pytest

from hf_dp import accounting
from hf_dp.accounting import PrivacyAccountant
from pld_reference import DELTA


BAD_ARGUMENTS = [
    ({"sample_rate": 0.0}, "sample_rate"),
    ({"sample_rate": -0.1}, "sample_rate"),
    ({"sample_rate": 1.5}, "sample_rate"),
    ({"noise_multiplier": 0.0}, "noise_multiplier"),
    ({"noise_multiplier": -1.0}, "noise_multiplier"),
    ({"noise_multiplier": float("nan")}, "noise_multiplier"),
    ({"delta": 0.0}, "delta"),
    ({"delta": 1.0}, "delta"),
    ({"delta": 2.0}, "delta"),
    ({"steps": -1}, "steps"),
    ({"steps": 2.5}, "steps"),
    ({"group_size": 0}, "group_size"),
    ({"group_size": 10**6}, "group_size"),   # beyond the tested domain: refused at once, not 7 TiB later
    ({"steps": 10**9}, "steps"),             # refused at once, not after minutes
    ({"delta": 1e-16}, "delta"),
]


@pytest.mark.parametrize("change, name", BAD_ARGUMENTS)
def test_bad_arguments_raise_clear_errors(change, name):
    kwargs = {"sample_rate": 0.01, "noise_multiplier": 1.0, "steps": 10, "delta": DELTA, "group_size": 1, **change}
    with pytest.raises(ValueError, match=name):
        accounting.epsilon(**kwargs)
    calibration = {k: v for k, v in kwargs.items() if k != "noise_multiplier"}
    if name != "noise_multiplier":
        with pytest.raises(ValueError, match=name):
            accounting.noise_multiplier(target_epsilon=1.0, **calibration)
    ledger = PrivacyAccountant()
    step = {k: kwargs[k] for k in ("sample_rate", "noise_multiplier", "group_size", "steps")}
    if name == "delta":
        ledger.step(**step)
        with pytest.raises(ValueError, match=name):
            ledger.epsilon(kwargs["delta"])
    else:
        with pytest.raises(ValueError, match=name):
            ledger.step(**step)
