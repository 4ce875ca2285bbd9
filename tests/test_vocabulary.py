"""hf_dp.vocabulary: one key per mechanism, from the two arguments a user sets, and one table that names each."""
from __future__ import annotations

import pytest

from hf_dp import DPTrainingArguments
from hf_dp.vocabulary import DP_MECHANISMS, MECHANISMS, PRIVACY_UNITS, SAMPLING_SCHEMES, mechanism, mechanism_of


def test_the_two_arguments_select_one_mechanism():
    assert mechanism_of("user", "uls") == "uls"
    assert mechanism_of("user", "ELS") == "els"  # case does not matter
    for sampling in ("uls", "els", None):
        assert mechanism_of("example", sampling) == "example"  # sampling is unused at the example level
    with pytest.raises(ValueError, match=r"privacy_unit='row': use one of \('user', 'example'\)"):
        mechanism_of("row", "uls")
    with pytest.raises(ValueError, match=r"sampling='shuffle': use one of \('uls', 'els'\)"):
        mechanism_of("user", "shuffle")
    with pytest.raises(ValueError, match="sampling=None"):
        mechanism_of("user", None)


def test_the_table_names_every_mechanism_once_and_maps_back_to_its_arguments():
    assert all(key == entry.key for key, entry in MECHANISMS.items())
    assert DP_MECHANISMS == tuple(key for key, entry in MECHANISMS.items() if entry.is_private)
    for key in DP_MECHANISMS:
        entry = MECHANISMS[key]
        assert entry.privacy_unit in PRIVACY_UNITS and entry.sampled_unit in ("users", "examples")
        assert mechanism_of(entry.privacy_unit, entry.sampling) == key
    assert {MECHANISMS[key].sampling for key in DP_MECHANISMS} - {None} == set(SAMPLING_SCHEMES)
    for attribute in ("label", "name", "description", "color"):
        values = [getattr(entry, attribute) for entry in MECHANISMS.values()]
        assert len(set(values)) == len(values), attribute  # plots and tables can tell them apart
    assert not MECHANISMS["non-private"].is_private and not MECHANISMS["public-only"].is_private


def test_a_key_is_looked_up_or_refused_naming_the_keys():
    assert mechanism("els") is MECHANISMS["els"]
    with pytest.raises(ValueError, match=r"mechanism='dp': use one of \('uls', 'els', 'example', 'non-private'"):
        mechanism("dp")


@pytest.mark.parametrize("unit, sampling, key", [("user", "uls", "uls"), ("user", "els", "els"),
                                                 ("example", "uls", "example")])
def test_the_arguments_name_their_mechanism_by_its_key(tmp_path, unit, sampling, key):
    args = DPTrainingArguments(str(tmp_path), privacy_unit=unit, sampling=sampling, use_cpu=True)
    assert args.mechanism == key


def test_perplexities_are_lower_is_better():
    from hf_dp.vocabulary import lower_is_better

    assert lower_is_better("perplexity") and lower_is_better("completion perplexity")
    assert not lower_is_better("accuracy") and not lower_is_better(None)
