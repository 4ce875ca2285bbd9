"""hf_dp.contribution: the data secret, the contribution bound G (given, or chosen with ε-DP), its ε and how the card
states its choice."""

from __future__ import annotations

from hf_dp import DPTrainingArguments
from hf_dp.contribution import data_secret


# ---- the data secret ----------------------------------------------------------------------------------------------


def test_secret_comes_from_os_entropy_unless_a_test_seed_is_given():
    args = DPTrainingArguments(output_dir="x", use_cpu=True)
    assert data_secret(args) != data_secret(args)
    seeded = DPTrainingArguments(output_dir="x", noise_seed=5, use_cpu=True)
    assert data_secret(seeded) == data_secret(seeded)
