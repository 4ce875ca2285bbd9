"""hf_dp.vocabulary: one key per mechanism, from the two arguments a user sets, and one table that names each."""
from __future__ import annotations

from dataclasses import replace

import pytest

from hf_dp import DPTrainingArguments
from hf_dp.mechanisms import ELS, ULS, ExampleLevel, get_mechanism
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


def table_problems(table: dict) -> list[str]:
    """What is wrong with a table of mechanisms: an entry filed under another key than its own; a private entry
    that no registered mechanism answers to, or whose two arguments select another key; a mechanism class of
    hf_dp (ULS, ELS, example-level) without its entry."""
    problems = [f"{key!r} holds the entry of {entry.key!r}" for key, entry in table.items() if entry.key != key]
    for key, entry in table.items():
        if not entry.is_private:
            continue
        try:
            registered = get_mechanism(key).key
        except ValueError:
            registered = None
        if registered != key:
            problems.append(f"{key!r}: no registered mechanism has this key")
        try:
            selected = mechanism_of(entry.privacy_unit, entry.sampling)
        except ValueError as error:
            selected = str(error)
        if selected != key:
            problems.append(f"{key!r}: its arguments select {selected!r}")
    problems += [f"{cls.__name__} ({cls.key!r}) has no entry" for cls in (ULS, ELS, ExampleLevel)
                 if cls.key not in table]
    return problems


def test_the_table_names_every_mechanism_once_and_maps_back_to_its_arguments():
    assert table_problems(MECHANISMS) == []
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


def test_a_broken_table_is_caught():
    """`table_problems` fails each way a table can go wrong, so its passing on the real table says something."""
    uls, els = MECHANISMS["uls"], MECHANISMS["els"]
    assert table_problems({**MECHANISMS, "els": uls}) == ["'els' holds the entry of 'uls'",
                                                          "'els': its arguments select 'uls'"]
    assert table_problems({key: entry for key, entry in MECHANISMS.items() if key != "example"}) == [
        "ExampleLevel ('example') has no entry"]
    assert table_problems({**MECHANISMS, "uls2": replace(uls, key="uls2")}) == [
        "'uls2': no registered mechanism has this key", "'uls2': its arguments select 'uls'"]
    assert table_problems({**MECHANISMS, "els": replace(els, sampling="uls")}) == ["'els': its arguments select 'uls'"]


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
