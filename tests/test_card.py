"""hf_dp.card: golden cards, Hub-readable front matter, what each kind of run must say.

Regenerate the golden files after a deliberate template change with
`HF_DP_REGENERATE_GOLDEN=1 pytest tests/test_card.py`, and review the diff.
"""
import os
from pathlib import Path

import numpy as np
import pytest
import yaml
from huggingface_hub import ModelCard
from huggingface_hub.repocard import metadata_load

from app_fixtures import privacy_report
from hf_dp.noise import noise_source
from hf_dp.card import render_privacy_card, write_privacy_card
from hf_dp.vocabulary import EVAL_KEYS, MECHANISMS

GOLDEN = Path(__file__).parent / "golden_cards"
REGENERATE = os.environ.get("HF_DP_REGENERATE_GOLDEN") == "1"

ULS_REPORT = {
    "epsilon": 7.9731,
    "epsilon_lower": 7.9105,
    "epsilon_estimate": 7.9422,
    "delta": 1e-05,
    "delta_accountant": 1e-05,
    "delta_floating_point": 1.6e-36,
    "noise_reach": 14.846575477801695,
    "target_epsilon": 8.0,
    "privacy_unit": "user",
    "sampling": "uls",
    "mechanism": "uls",
    "noise_multiplier": 0.8125,
    "logging_noise_multiplier": 8.125,
    "max_loss": 5.0,
    "effective_noise_multiplier": 0.80449,
    "sample_rate": 0.0625,
    "expected_batch_size": 68.8,
    "steps": 300,
    "max_grad_norm": 1.0,
    "contribution_bound": 16,
    "num_users": 1101,
    "num_examples": 14920,
    "accountant": "prv-accountant (PRV, Gopi et al. 2021); mixture-of-Gaussians for ELS",
    "mechanism_description": MECHANISMS["uls"].description,
    "epsilon_group_privacy": None,
    "noise_seed": "os-entropy",
    "noise_source": noise_source(secure=False),
}
ELS_REPORT = dict(
    ULS_REPORT,
    sampling="els",
    mechanism="els",
    epsilon=2.9874,
    target_epsilon=3.0,
    expected_batch_size=25.6,
    epsilon_lower=2.9611,
    epsilon_estimate=2.9745,
    noise_multiplier=1.25,
    logging_noise_multiplier=12.5,
    effective_noise_multiplier=1.23768,
    sample_rate=0.004,
    contribution_bound=7,
    num_examples=6412,
    mechanism_description=MECHANISMS["els"].description,
    epsilon_group_privacy=58.316,
)
EXAMPLE_REPORT = dict(
    ULS_REPORT,
    privacy_unit="example",
    sampling=None,  # unused at the example level
    mechanism="example",
    contribution_bound=None,
    num_examples=24217,
    sample_rate=0.01,
    expected_batch_size=242.2,
    mechanism_description=MECHANISMS["example"].description,
    noise_seed="fixed seed for testing: 1234",
    no_guarantee=True,  # what the trainer's report adds for a fixed seed
    noise_source="numpy's Philox4x64-10, keyed per step (128 bits) by BLAKE2b of the fixed noise_seed=1234 (NOT a "
                 "secret: no privacy guarantee), counter = (element, parameter); Box-Muller in float64",
    logging_noise_multiplier=None,  # private_logging=False
    max_loss=None,
    effective_noise_multiplier=0.8125,
)
# Adaptive clipping (Andrew et al. 2021): C chosen privately from noised counts; the loss alone is logged besides.
ADAPTIVE_REPORT = dict(
    ULS_REPORT,
    noise_multiplier=0.8141,  # σ_Δ: σ_eff = 0.80449 split with σ_b = 3.44 = 68.8/20 and r = 10
    logging_noise_multiplier=8.141,
    max_grad_norm=1.0,
    adaptive_clipping=True,
    final_max_grad_norm=0.02137,
    target_unclipped_quantile=0.5,
    clipping_learning_rate=0.2,
    clipping_count_noise=3.44,
)
NON_PRIVATE_REPORT = {"non_private": True, "steps": 300, "num_users": 1101, "num_examples": 24217}

COMMON = {"base_model": "sentence-transformers/all-MiniLM-L6-v2", "dataset_name": "shakespeare"}
CASES = {
    "uls": (ULS_REPORT, dict(COMMON, eval_result=0.6125, baseline_result=0.4437, non_private_result=0.7016)),
    "els": (ELS_REPORT, dict(COMMON, eval_result=0.5874, baseline_result=0.4437)),
    "example": (EXAMPLE_REPORT, dict(COMMON, eval_result=0.6402)),
    "uls_adaptive": (ADAPTIVE_REPORT, dict(COMMON, eval_result=0.6125, baseline_result=0.4437)),
    "non_private": (NON_PRIVATE_REPORT, dict(COMMON, eval_result=0.7016, baseline_result=0.4437)),
    "causal_lm_no_eval": (
        ULS_REPORT,
        {"base_model": "gpt2", "task": "text-generation", "metric_name": "perplexity",
         "library_name": "peft",
         "extra_not_covered": ["**Generated text.** Sampling settings are not part of the guarantee."]},
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_card(name):
    report, kwargs = CASES[name]
    rendered = str(render_privacy_card(report, **kwargs))
    golden = GOLDEN / f"privacy_card_{name}.md"
    if REGENERATE:
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(rendered, encoding="utf-8")
    assert golden.exists(), f"{golden} missing: run with HF_DP_REGENERATE_GOLDEN=1"
    assert rendered == golden.read_text(encoding="utf-8")


@pytest.mark.parametrize("name", sorted(CASES))
def test_front_matter_is_hub_metadata_and_privacy_block_round_trips(name, tmp_path):
    report, kwargs = CASES[name]
    path = write_privacy_card(report, tmp_path / "out", **kwargs)
    assert path == tmp_path / "out" / "README.md"

    metadata = metadata_load(path)
    assert metadata["privacy"] == report  # field for field, same values
    assert list(metadata["privacy"]) != [] and metadata["base_model"] == kwargs["base_model"]
    assert metadata["library_name"] == kwargs.get("library_name", "transformers")
    assert metadata["pipeline_tag"] == kwargs.get("task", "text-classification")

    data = ModelCard.load(path).data  # parses model-index back into EvalResults
    assert data.base_model == kwargs["base_model"]
    if "eval_result" in kwargs:
        (result,) = data.eval_results
        assert result.metric_value == kwargs["eval_result"]
        assert result.metric_type == kwargs.get("metric_name", "accuracy")
        # the evaluation figures under the names of the card's arguments and the result JSON
        evaluation = metadata["dp_evaluation"]
        assert set(evaluation) <= set(EVAL_KEYS)
        assert evaluation["metric_name"] == kwargs.get("metric_name", "accuracy")
        for key in ("eval_result", "baseline_result", "non_private_result"):
            assert evaluation.get(key) == kwargs.get(key), key
    else:
        assert data.eval_results is None and "model-index" not in metadata


def test_tags_name_the_unit():
    def tags(report):
        return render_privacy_card(report, base_model="m").data.tags

    assert {"differential-privacy", "dp-sgd", "user-level-dp", "dp-uls"} <= set(tags(ULS_REPORT))
    assert {"differential-privacy", "user-level-dp", "dp-els"} <= set(tags(ELS_REPORT))
    secret = dict(EXAMPLE_REPORT, noise_seed="os-entropy", no_guarantee=None)
    assert "example-level-dp" in tags(secret) and "user-level-dp" not in tags(secret)
    assert "no-privacy-guarantee" in tags(EXAMPLE_REPORT) and "example-level-dp" not in tags(EXAMPLE_REPORT)
    assert "differential-privacy" not in tags(NON_PRIVATE_REPORT)
    assert "non-private" in tags(NON_PRIVATE_REPORT)


def test_user_level_card_states_the_guarantee():
    text = render_privacy_card(ULS_REPORT, base_model="m", baseline_result=0.4, eval_result=0.6).text
    assert "**(7.98, 1e-05)-differential privacy at the level of users**" in text
    assert "whole contribution —\nall of their rows, at most G = 16 examples" in text
    assert "between\n7.910 (lower bound) and 7.974 (upper bound)" in text
    assert "| Public-only baseline (pretrained, no private data) | 0.4 |" in text
    assert "What the guarantee covers" in text
    for topic in ("pretraining data", "Hyperparameter search", "Preprocessing decisions",
                  "public-only baseline comparison", "noise seed"):
        assert topic in text


def test_trainer_report_extras_are_kept_and_shown(tmp_path):
    report = dict(ULS_REPORT, target_epsilon=8.0, expected_batch_size=64)
    path = write_privacy_card(report, tmp_path, base_model="m")
    assert metadata_load(path)["privacy"] == report
    assert "| Target ε (`target_epsilon`) | 8 |" in path.read_text(encoding="utf-8")


def test_adaptive_card_states_that_c_was_chosen_privately():
    text = render_privacy_card(ADAPTIVE_REPORT, base_model="m").text
    assert "chosen privately during training by adaptive\nclipping (Andrew, Thakkar, McMahan and Ramaswamy 2021)" \
        in text
    assert "| Noise std of the unclipped count σ_b (`clipping_count_noise`) | 3.44 |" in text
    assert "from 1 at the first step to 0.02137 after the last" in text
    assert "σ_eff = (σ⁻² + (2σ_b)⁻² + σ_log⁻²)^(-1/2) = 0.8044" in text
    assert "as C is here: adaptive clipping" in text
    assert "and clipped count σ_log" not in text  # the adaptive count replaces the logged clipped count
    fixed = render_privacy_card(dict(ULS_REPORT, adaptive_clipping=False, final_max_grad_norm=None,
                                     target_unclipped_quantile=None, clipping_learning_rate=None,
                                     clipping_count_noise=None), base_model="m").text
    assert fixed == render_privacy_card(ULS_REPORT, base_model="m").text  # a fixed C reads as before


def test_epsilon_is_never_rounded_down():
    text = render_privacy_card(dict(ULS_REPORT, epsilon=7.9801), base_model="m").text
    assert "(7.99, 1e-05)" in text and "(7.98, " not in text


def test_els_card_shows_group_privacy_beside_mog():
    text = render_privacy_card(ELS_REPORT, base_model="m").text
    assert "mixture-of-Gaussians accountant" in text
    assert "gives only **ε = 58.32** (`epsilon_group_privacy`)" in text
    assert "(2.99, 1e-05)-differential privacy at the level of users" in text


def test_example_level_card_warns_users_are_not_protected():
    secret = dict(EXAMPLE_REPORT, noise_seed="os-entropy", no_guarantee=None, noise_source=ULS_REPORT["noise_source"])
    text = render_privacy_card(secret, base_model="m").text
    assert "at the level of single\nexamples (rows)" in text
    assert "Example-level only: users are not protected as a whole." in text
    assert "Users with many rows." in text
    assert "at the level of users" not in text


def test_fixed_noise_seed_voids_the_guarantee_in_the_card():
    """Headline, metadata and the noise rows say plainly there is no guarantee; no sentence states one."""
    card = render_privacy_card(EXAMPLE_REPORT, base_model="m")
    text, metadata = card.text, card.data.to_dict()
    assert "with DP-SGD but a fixed noise seed: **it carries NO privacy guarantee**" in text.split("##")[0]
    assert "> **⚠️ No privacy guarantee.** The noise of this run was drawn from a fixed seed" in text
    assert "Training satisfies" not in text and "-differential privacy at the level" not in text
    assert metadata["privacy"]["no_guarantee"] is True and "no-privacy-guarantee" in metadata["tags"]
    assert not {"differential-privacy", "example-level-dp", "user-level-dp"} & set(metadata["tags"])
    assert "| Noise seed (`noise_seed`) | fixed seed for testing: 1234 — known, not a secret: NO privacy guarantee |" \
        in text
    assert "OS entropy" not in text.split("### Accounting")[0] and "noise_seed=1234 (NOT a secret" in text
    assert "Nothing: the noise came from a fixed seed" in text
    assert "with a fixed seed this model has no effective privacy guarantee" in text
    # A hand-built report with a fixed seed gets the label too, even without no_guarantee
    unlabelled = {k: v for k, v in EXAMPLE_REPORT.items() if k != "no_guarantee"}
    assert render_privacy_card(unlabelled, base_model="m").data.to_dict()["privacy"]["no_guarantee"] is True


def test_non_private_card_says_there_is_no_guarantee():
    text = render_privacy_card(NON_PRIVATE_REPORT, base_model="m", eval_result=0.7).text
    assert "No privacy guarantee." in text and "NO formal protection" in text
    assert "differential privacy at the level" not in text
    assert "What the guarantee covers" not in text


def test_numpy_values_become_plain_yaml(tmp_path):
    report = dict(ULS_REPORT, epsilon=np.float64(7.5), steps=np.int64(300), sample_rate=np.float32(0.0625))
    path = write_privacy_card(report, tmp_path, base_model="m")
    privacy = metadata_load(path)["privacy"]
    assert privacy["epsilon"] == 7.5 and privacy["steps"] == 300 and privacy["sample_rate"] == 0.0625
    assert "!!python" not in path.read_text(encoding="utf-8")


@pytest.mark.parametrize(
    "change, match",
    [
        ({"epsilon": None}, "missing \\['epsilon'\\]"),
        ({"mechanism": None}, "missing \\['mechanism'\\]"),
        ({"mechanism": "DP-SGD with user-level sampling"}, "mechanism='DP-SGD with user-level sampling': use one of"),
        ({"mechanism": "public-only"}, "mechanism='public-only': use one of"),
        ({"privacy_unit": "row"}, "privacy_unit='row' does not go with mechanism='uls'"),
        ({"sampling": "example"}, "sampling='example' does not go with mechanism='uls'"),
        ({"sampling": "els"}, "sampling='els' does not go with mechanism='uls'"),
        ({"sampling": "els", "mechanism": "els", "contribution_bound": None}, "ELS needs contribution_bound"),
        ({"epsilon": "7.98"}, "epsilon='7.98' must be a number, not str"),
        ({"steps": "300"}, "steps='300' must be a number"),
        ({"adaptive_clipping": True}, r"adaptive_clipping=True but is missing \['final_max_grad_norm'"),
        (dict(ADAPTIVE_REPORT, clipping_count_noise="3"), "clipping_count_noise='3' must be a number"),
    ],
)
def test_bad_reports_are_refused(change, match):
    with pytest.raises(ValueError, match=match) as error:
        render_privacy_card(dict(ULS_REPORT, **change), base_model="m")
    assert "\n" not in str(error.value)


def test_example_level_report_has_no_sampling():
    with pytest.raises(ValueError, match="sampling='uls' does not go with mechanism='example'"):
        render_privacy_card(dict(EXAMPLE_REPORT, sampling="uls"), base_model="m")
    text = render_privacy_card(EXAMPLE_REPORT, base_model="m").text
    assert "| Mechanism (`mechanism`) | " + MECHANISMS["example"].name + " |" in text
    assert "| Sampling (`sampling`)" not in text  # unused at the example level


def test_card_names_the_mechanism_from_the_vocabulary():
    for report in (ULS_REPORT, ELS_REPORT, EXAMPLE_REPORT):
        entry = MECHANISMS[report["mechanism"]]
        text = render_privacy_card(report, base_model="m").text
        assert f"Mechanism (`{entry.key}`) — {entry.description}." in text
        assert f"| Mechanism (`mechanism`) | {entry.name} |" in text
        assert f"| Expected {entry.sampled_unit} per step (`expected_batch_size`) |" in text


def test_model_cards_folder_links_the_packaged_template():
    link = Path(__file__).parents[1] / "model_cards" / "privacy_card_template.md"
    packaged = Path(__file__).parents[1] / "hf_dp" / "templates" / "privacy_card.md"
    assert link.is_symlink() and link.resolve() == packaged.resolve()
    assert link.read_text(encoding="utf-8").startswith("---\n{{ card_data }}\n---\n")


def test_golden_front_matter_is_valid_yaml():
    for golden in sorted(GOLDEN.glob("privacy_card_*.md")):
        front = golden.read_text(encoding="utf-8").split("---\n")[1]
        assert isinstance(yaml.safe_load(front), dict), golden


# ---- every stated ε and δ is rounded up ---------------------------------------------------------------------------


def test_every_stated_epsilon_and_delta_is_rounded_up(tmp_path):
    report = dict(privacy_report("els", 2.98712, 3.0), delta=4.16493e-5, epsilon_lower=2.96119,
                  epsilon_estimate=2.97412, epsilon_group_privacy=58.3121, sample_rate=0.0812345,
                  noise_multiplier=1.23456)
    path = write_privacy_card(report, tmp_path, base_model="m")
    text = path.read_text(encoding="utf-8")
    assert "**(2.99, 4.17e-05)-differential privacy" in text and "4.16e-05" not in text
    assert "| δ (`delta`) | 4.17e-05 |" in text
    assert "between\n2.961 (lower bound) and 2.988 (upper bound)" in text  # interval rounded outwards
    assert "estimate 2.975" in text and "**ε = 58.32**" in text
    assert "| Sample rate q (`sample_rate`) | 0.08124 |" in text  # q up, σ down: never flattering
    assert "| Noise multiplier σ (`noise_multiplier`) | 1.234 |" in text
    privacy = metadata_load(path)["privacy"]  # the front matter keeps the exact values
    for key in ("epsilon", "delta", "epsilon_lower", "epsilon_estimate", "epsilon_group_privacy"):
        assert privacy[key] == report[key]
