"""hf_dp.report: the privacy report from the budget and the arguments, and Trainer's card fields mapped onto it."""
from __future__ import annotations

import pytest
from huggingface_hub.repocard import metadata_load

from app_fixtures import privacy_report as fixed_report
from hf_dp import accounting
from hf_dp.budget import PrivacyBudget
from hf_dp.card import write_privacy_card
from hf_dp.privacy_plan import plan_privacy
from hf_dp.report import add_card_metadata, base_model_name, card_fields, privacy_report
from hf_dp.vocabulary import MECHANISMS
from trainer_fixtures import make_args, tiny_bert, user_partition

PARTITION = user_partition([1, 2, 3, 4] * 25, contribution_bound=3)  # 100 users, 225 rows kept


def report_after(tmp_path, steps=3, bound_epsilon=0.0, **overrides):
    args = make_args(tmp_path, max_steps=10, **{"contribution_bound": 3, **overrides})
    budget = PrivacyBudget(plan_privacy(args, PARTITION, noised_elements=1000), args.target_epsilon, bound_epsilon)
    for _ in range(steps):
        budget.record_step()
    return privacy_report(budget, args, clipping_norm=0.7, num_users=1234, num_examples=56789), budget


def test_the_report_states_the_ledgers_epsilon_and_the_plan(tmp_path):
    report, budget = report_after(tmp_path)
    plan = budget.plan
    assert (report["epsilon_lower"], report["epsilon_estimate"], report["epsilon"]) == budget.epsilon_bounds()
    assert report["epsilon"] == pytest.approx(accounting.epsilon(
        sample_rate=plan.sample_rate, noise_multiplier=plan.effective_noise_multiplier, steps=3, delta=plan.delta))
    assert (report["steps"], report["delta"], report["sample_rate"]) == (3, plan.delta, plan.sample_rate)
    assert (report["mechanism"], report["sampling"], report["privacy_unit"]) == ("uls", "uls", "user")
    assert report["mechanism_description"] == MECHANISMS["uls"].description
    assert report["max_grad_norm"] == 1.0 and report["adaptive_clipping"] is False  # the argument: C
    assert report["final_max_grad_norm"] is None and report["clipping_count_noise"] is None
    assert (report["num_users"], report["num_examples"]) == (1200, 57000)  # rounded: not covered by ε
    assert report["epsilon_group_privacy"] is None and report["contribution_bound_epsilon"] == 0
    assert report["contribution_bound_choice"].startswith("given")
    assert report["noise_seed"] == "fixed seed for testing: 1234"


def test_the_stated_delta_adds_what_the_noise_samplers_finite_support_leaves(tmp_path):
    from hf_dp.accounting.floating_point import NOISE_REACH, sampler_delta

    report, budget = report_after(tmp_path)
    draws = 3 * (1000 + 2)  # 3 steps of 1000 noised parameters and the two logged sums
    added = sampler_delta(epsilon=report["epsilon"], delta=budget.plan.delta, draws=draws)
    assert report["delta_floating_point"] == added > 0 and report["noise_reach"] == NOISE_REACH > 12
    assert report["delta"] == report["delta_accountant"] + added and report["delta_accountant"] == budget.plan.delta
    assert report_after(tmp_path, steps=0)[0]["delta_floating_point"] == 0


def test_the_choice_of_g_is_part_of_epsilon_and_not_of_training(tmp_path):
    report, _ = report_after(tmp_path, bound_epsilon=0.1, contribution_bound_epsilon=0.1)
    assert report["contribution_bound_epsilon"] == 0.1
    assert report["epsilon"] == pytest.approx(report["epsilon_training"] + 0.1)
    before, _ = report_after(tmp_path, steps=0, bound_epsilon=0.1)
    assert before["epsilon"] == 0.1 and before["epsilon_training"] == 0


def test_els_reports_group_privacy_and_example_level_no_sampling(tmp_path):
    els, budget = report_after(tmp_path, sampling="els")
    assert els["mechanism"] == "els" and "mixture-of-Gaussians" in els["accountant"]
    assert els["epsilon_group_privacy"] > els["epsilon"]  # the loose bound the tight accountant beats
    example, _ = report_after(tmp_path, privacy_unit="example", contribution_bound=None)
    assert (example["mechanism"], example["sampling"], example["epsilon_group_privacy"]) == ("example", None, None)
    quiet, _ = report_after(tmp_path, private_logging=False)
    assert quiet["max_loss"] is None and quiet["logging_noise_multiplier"] is None
    seeded, _ = report_after(tmp_path, noise_seed=None)
    assert seeded["noise_seed"] == "os-entropy"
    assert "not cryptographically" in seeded["noise_source"]
    secure, _ = report_after(tmp_path, secure_noise=True)
    assert secure["noise_source"].startswith("cryptographic: SHAKE-256")


def test_trainers_card_fields_map_onto_the_privacy_card():
    assert card_fields(model_name="m", finetuned_from="org/base", tasks=["text-classification"], dataset_tags=None,
                       dataset="Reviews", dataset_args=None) == \
        {"model_name": "m", "base_model": "org/base", "task": "text-classification", "dataset_name": "Reviews"}
    assert card_fields(model_name=None, finetuned_from=None, tasks=None, dataset_tags=["org/a"], dataset="b",
                       dataset_args=None) == {"dataset_name": "org/a"}  # dataset_tags first
    with pytest.raises(ValueError, match=r"tasks=\['a', 'b'\]\): the privacy card states one"):
        card_fields(model_name=None, finetuned_from=None, tasks=["a", "b"], dataset_tags=None, dataset=None,
                    dataset_args=None)
    with pytest.raises(ValueError, match="leave dataset_args unset"):
        card_fields(model_name=None, finetuned_from=None, tasks=None, dataset_tags=None, dataset=None,
                    dataset_args="en")


def test_card_metadata_is_added_after_the_cards_own(tmp_path):
    path = write_privacy_card(fixed_report("uls", 7.9, 8.0), tmp_path, base_model="m")
    untouched = path.read_text(encoding="utf-8")
    add_card_metadata(path)
    assert path.read_text(encoding="utf-8") == untouched  # nothing given: nothing rewritten
    own = metadata_load(path)["tags"]
    add_card_metadata(path, language="en", license="mit", tags=["mine", own[0]])
    meta = metadata_load(path)
    assert (meta["language"], meta["license"]) == ("en", "mit")
    assert meta["tags"] == own + ["mine"]  # after the card's own, no duplicate
    assert meta["privacy"]["epsilon"] == 7.9  # the privacy block is kept


def test_the_base_model_is_named_only_when_it_is_a_hub_id(tmp_path):
    from hf_dp.card import hub_model_id, render_privacy_card

    model = tiny_bert()
    model.config._name_or_path = "org/base-model"
    assert base_model_name(model) == "org/base-model"
    model.config._name_or_path = ""
    assert base_model_name(model) is None
    assert [hub_model_id(name) for name in ("org/base-model", "gpt2", str(tmp_path), "/home/alice/model", "~/m",
                                            "./m", "a/b/c", "", None)] == ["org/base-model", "gpt2"] + [None] * 7
    card = render_privacy_card(fixed_report("uls", 7.9, 8.0), base_model=str(tmp_path / "smollm2"))
    assert "base_model" not in card.data.to_dict() and str(tmp_path) not in card.text
    assert "Fine-tuned from a local model with" in card.text.replace("\n", " ")
