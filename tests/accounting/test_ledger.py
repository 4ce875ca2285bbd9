"""hf_dp.accounting.ledger: the PrivacyAccountant that travels with training (segments, state, ε after more steps)."""
import json

import pytest

from hf_dp import accounting
from hf_dp.accounting import PrivacyAccountant
from pld_reference import DELTA, assert_matches_reference, reference_epsilon


def test_empty_ledger():
    ledger = PrivacyAccountant()
    assert ledger.steps == 0 and ledger.history == []
    assert ledger.epsilon(DELTA) == 0.0
    assert ledger.epsilon_bounds(DELTA) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="empty"):
        ledger.epsilon_after(DELTA)
    assert ledger.epsilon_after(DELTA, steps=10, sample_rate=0.01, noise_multiplier=1.0) == accounting.epsilon(
        sample_rate=0.01, noise_multiplier=1.0, steps=10, delta=DELTA)


def test_ledger_merges_segments_and_composes_them():
    ledger = PrivacyAccountant()
    for _ in range(5):
        ledger.step(sample_rate=0.02, noise_multiplier=1.2)
    ledger.step(sample_rate=0.02, noise_multiplier=1.2, steps=95)
    ledger.step(sample_rate=0.05, noise_multiplier=2.0, steps=50)
    ledger.step(sample_rate=0.02, noise_multiplier=1.2, group_size=4, steps=30)
    assert ledger.steps == 180
    assert ledger.history == [
        {"sample_rate": 0.02, "effective_noise_multiplier": 1.2, "group_size": 1, "steps": 100},
        {"sample_rate": 0.05, "effective_noise_multiplier": 2.0, "group_size": 1, "steps": 50},
        {"sample_rate": 0.02, "effective_noise_multiplier": 1.2, "group_size": 4, "steps": 30},
    ]
    assert "mixture of Gaussians" in ledger.description and "180 steps" in ledger.description
    reference = reference_epsilon([(0.02, 1.2, 1, 100), (0.05, 2.0, 1, 50), (0.02, 1.2, 4, 30)])
    assert_matches_reference(ledger.epsilon_bounds(DELTA), reference)


def test_ledger_state_dict_round_trips_through_json():
    ledger = PrivacyAccountant()
    ledger.step(sample_rate=0.02, noise_multiplier=1.2, steps=40)
    ledger.step(sample_rate=0.03, noise_multiplier=0.9, group_size=2, steps=7)
    text = json.dumps(ledger.state_dict())
    restored = PrivacyAccountant()
    restored.load_state_dict(json.loads(text))
    assert restored.history == ledger.history
    assert restored.epsilon(DELTA) == ledger.epsilon(DELTA)
    restored.step(sample_rate=0.03, noise_multiplier=0.9, group_size=2)
    assert restored.history[-1]["steps"] == 8  # resumes merging into the last segment


def test_a_ledger_of_the_first_format_is_still_read():
    """Format 1 named σ_eff `noise_multiplier`, the card's name for σ: format 2 says `effective_noise_multiplier`."""
    ledger = PrivacyAccountant()
    ledger.step(sample_rate=0.02, noise_multiplier=1.2, steps=40)
    state = ledger.state_dict()
    assert state["format"] == 2 and "noise_multiplier" not in state["segments"][0]
    old = {"format": 1, "segments": [{"sample_rate": 0.02, "noise_multiplier": 1.2, "group_size": 1, "steps": 40}]}
    restored = PrivacyAccountant()
    restored.load_state_dict(old)
    assert restored.history == ledger.history and restored.epsilon(DELTA) == ledger.epsilon(DELTA)


@pytest.mark.parametrize("state, match", [
    ({"segments": []}, "format"),
    ({"format": 3, "segments": []}, "format"),
    ({"format": 2, "segments": [{"sample_rate": 0.1, "noise_multiplier": 1.0, "group_size": 1, "steps": 3}]}, "keys"),
    ({"format": 1, "segments": [{"sample_rate": 0.1}]}, "keys"),
    ({"format": 1, "segments": [{"sample_rate": 1.5, "noise_multiplier": 1.0, "group_size": 1, "steps": 3}]},
     "sample_rate"),
    ({"format": 1, "segments": [{"sample_rate": 0.1, "noise_multiplier": 1.0, "group_size": 1, "steps": -3}]},
     "steps"),
    ("not a dict", "format"),
])
def test_load_state_dict_validates(state, match):
    ledger = PrivacyAccountant()
    ledger.step(sample_rate=0.1, noise_multiplier=1.0)
    with pytest.raises(ValueError, match=match):
        ledger.load_state_dict(state)
    assert ledger.steps == 1  # untouched


def test_epsilon_after_is_the_epsilon_after_stepping():
    ledger = PrivacyAccountant()
    ledger.step(sample_rate=0.01, noise_multiplier=1.1, steps=200)
    for _ in range(3):
        predicted = ledger.epsilon_after(DELTA, steps=1)
        ledger.step(sample_rate=0.01, noise_multiplier=1.1)
        assert ledger.epsilon(DELTA) == predicted
    assert ledger.epsilon_after(DELTA, steps=0) == ledger.epsilon(DELTA)
    assert ledger.epsilon(DELTA) == accounting.epsilon(sample_rate=0.01, noise_multiplier=1.1, steps=203,
                                                       delta=DELTA)
    # with other parameters: a new segment
    predicted = ledger.epsilon_after(DELTA, steps=20, noise_multiplier=2.0, group_size=3)
    ledger.step(sample_rate=0.01, noise_multiplier=2.0, group_size=3, steps=20)
    assert ledger.epsilon(DELTA) == predicted
    assert predicted > accounting.epsilon(sample_rate=0.01, noise_multiplier=1.1, steps=203, delta=DELTA)


def test_pure_dp_releases_add_to_epsilon_and_travel_with_the_state():
    ledger = PrivacyAccountant()
    ledger.record_pure_dp("contribution_bound", 0.1)
    assert ledger.steps == 0 and ledger.pure_dp_epsilon == 0.1
    assert ledger.epsilon_bounds(DELTA) == (0.1, 0.1, 0.1)  # before any DP-SGD step: the release alone
    ledger.step(sample_rate=0.02, noise_multiplier=1.2, steps=30)
    sgd = accounting.epsilon(sample_rate=0.02, noise_multiplier=1.2, steps=30, delta=DELTA)
    assert ledger.epsilon(DELTA) == pytest.approx(sgd + 0.1, rel=1e-12)  # basic composition with the steps
    restored = PrivacyAccountant()
    restored.load_state_dict(json.loads(json.dumps(ledger.state_dict())))
    assert restored.pure_dp == [{"label": "contribution_bound", "epsilon": 0.1}]
    assert restored.epsilon(DELTA) == ledger.epsilon(DELTA)
    for bad in (0.0, -1.0, float("inf"), float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match="must be a positive finite number"):
            ledger.record_pure_dp("x", bad)
    assert ledger.pure_dp_epsilon == 0.1  # nothing recorded by a refused call


def test_the_names_of_hf_dp_0_1_0_still_work_and_warn():
    """`mechanism` names only a key of `hf_dp.vocabulary.MECHANISMS`; the accountant's old names are deprecated
    aliases (`PrivacyAccountant.mechanism`, `hf_dp.accounting.MixtureOfGaussiansMechanism` and `describe_mechanism`)."""
    ledger = PrivacyAccountant()
    ledger.step(sample_rate=0.02, noise_multiplier=1.2, steps=3)
    with pytest.warns(DeprecationWarning, match="use PrivacyAccountant.description"):
        assert ledger.mechanism == ledger.description == "3 steps of " + accounting.describe_accounting(1)
    with pytest.warns(DeprecationWarning, match="use hf_dp.accounting.MixtureOfGaussiansPRV"):
        from hf_dp.accounting import MixtureOfGaussiansMechanism
    assert MixtureOfGaussiansMechanism is accounting.MixtureOfGaussiansPRV
    with pytest.warns(DeprecationWarning, match="use hf_dp.accounting.describe_accounting"):
        assert accounting.describe_mechanism is accounting.describe_accounting
    assert "MixtureOfGaussiansMechanism" not in accounting.__all__ and "describe_mechanism" not in accounting.__all__
    with pytest.raises(AttributeError):
        accounting.no_such_name  # noqa: B018
