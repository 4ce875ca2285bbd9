"""A mechanism added from outside hf_dp: one subclass, registered, is planned, trained, resumed and published.

`FixedBoundULS` is ULS whose G is fixed at 3 by the mechanism itself, with its own names and card sentence. Nothing
in hf_dp names it: the planner, the arguments, the trainer, the report, the card and publish's check all ask the
registry.
"""
from __future__ import annotations

import json

import pytest

from hf_dp import mechanism_table
from hf_dp.card import write_privacy_card
from hf_dp.hub import check_privacy_card
from hf_dp.mechanisms import MECHANISMS, ULS, register_mechanism, unregister_mechanism
from trainer_fixtures import make_trainer

FIXED_G = 3
CARD_SENTENCE = "Each user's gradient is the mean over at most 3 of their examples, G being fixed by the mechanism."


class FixedBoundULS(ULS):
    """ULS with G fixed at 3: the bound is part of the mechanism, never read from the data."""

    key = "uls-g3"
    sampling = "uls-g3"
    label = "user-level DP, ULS with G = 3"
    name = "ULS with a fixed G of 3"
    description = "user-level sampling with G fixed at 3: Poisson-sampled users, clipped mean gradient, Gaussian noise"
    marker = "v"
    color = "tab:purple"
    card_step = CARD_SENTENCE + (
        "\nEach step Poisson-samples users with probability q; a sampled user's gradient is clipped to norm C;"
        "\nGaussian noise N(0, σ²C²I) is added once to the sum, divided by the expected number of users per step.")

    def planned_bound(self, counts, contribution_bound, **budget):
        return FIXED_G, "G is fixed at 3 by the mechanism"

    def choose_contribution_bound(self, counts, **draw):
        return FIXED_G

    def bound_rule(self) -> str:
        return "G fixed at 3 by the mechanism"


@pytest.fixture
def fixed_bound_uls():
    """The toy registered for one test, then removed (the built-in registry is left as it was)."""
    register_mechanism(FixedBoundULS)
    yield FixedBoundULS
    unregister_mechanism(FixedBoundULS.key)
    assert FixedBoundULS.key not in MECHANISMS


def test_the_planner_gives_the_registered_mechanism_its_row(fixed_bound_uls):
    rows = mechanism_table.compare(users=500, examples_per_user=6, examples_per_step=60, steps=50, target_epsilon=4.0)
    assert [row["mechanism"] for row in rows] == ["uls", "els", "example", "uls-g3"]
    toy = rows[-1]
    assert (toy["label"], toy["contribution_bound"], toy["sampled_unit"]) == (FixedBoundULS.label, 3, "users")
    assert toy["note"] == "G is fixed at 3 by the mechanism"
    uls = mechanism_table.compare(users=500, examples_per_user=6, examples_per_step=60, steps=50, target_epsilon=4.0,
                                  contribution_bound=3)[0]  # ULS at the same G: the same numbers
    for name in ("sample_rate", "expected_batch_size", "noise_multiplier", "delta", "sampler_delta"):
        assert toy[name] == uls[name], name


def test_a_registered_mechanism_trains_resumes_and_publishes(fixed_bound_uls, tmp_path):
    settings = dict(sampling="uls-g3", contribution_bound=FIXED_G, noise_seed=None, max_steps=4)
    first = make_trainer(tmp_path / "a", save_strategy="steps", save_steps=2, **settings)
    assert first.args.mechanism == "uls-g3" and first.privacy_plan.mechanism == "uls-g3"
    first.train()
    checkpoint = tmp_path / "a" / "out" / "checkpoint-2"
    assert json.loads((checkpoint / "dp_ledger.json").read_text())["mechanism"] == "uls-g3"
    resumed = make_trainer(tmp_path / "b", **settings)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.privacy_plan == first.privacy_plan and resumed.accountant.steps == 4
    report, ledger = resumed.privacy_report(), resumed.privacy_ledger()
    assert report["epsilon"] == pytest.approx(first.privacy_report()["epsilon"], rel=1e-9)
    assert (report["mechanism"], report["sampling"]) == ("uls-g3", "uls-g3")
    assert report["mechanism_description"] == FixedBoundULS.description

    folder = tmp_path / "card"
    write_privacy_card(report, folder, ledger=ledger, base_model="test/tiny", eval_result=0.7, baseline_result=0.4)
    text = (folder / "README.md").read_text()
    assert CARD_SENTENCE in text.replace("\n", " ") and "dp-uls-g3" in text
    privacy = check_privacy_card(folder)  # publish's check: every figure and sentence re-rendered from the ledger
    assert privacy["mechanism"] == "uls-g3" and privacy["epsilon"] == pytest.approx(report["epsilon"])
