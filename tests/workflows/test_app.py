"""hf_dp.workflows.app: the page builds; the budget, compare, results and train wiring works on a fabricated results
folder, in the vocabulary of `hf_dp.vocabulary` (mechanism keys, `eval_result`/`baseline_result`, `expected_batch_size`
with its unit, the planner's `examples_per_step`).

The browser-level checks are in test_app_browser.py; here the functions behind each tab are called directly.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from app_fixtures import (
    CHAT_SYSTEM_PROMPT,
    LABELS,
    make_chat_results_dir,
    make_chat_tokenizer,
    make_results_dir,
    make_tokenizer,
    tiny_chat_lm,
    tiny_classifier,
)
from hf_dp.vocabulary import MECHANISMS
from hf_dp.workflows import app
from hf_dp.workflows.app import budget as budget_tab
from hf_dp.workflows.app import compare
from hf_dp.workflows.app import training

SMALL = dict(users=200, examples_per_user=2, examples_per_step=40, steps=20)  # fast planner calls: 400 examples


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return make_results_dir(tmp_path_factory.mktemp("fabricated"))


def sigma_of(headline: str) -> float:
    match = re.search(r"σ = ([0-9.]+)(?: at G = \d+)?\*\*", headline)
    assert match, headline
    return float(match.group(1))


def budget(results, epsilon, delta=1e-4, unit="user", sampling="uls", fixed=1.0, bound=None, previous=None,
           **overrides):
    """budget_view's (headline, table); `budget_state` gives the third value too."""
    return budget_state(results, epsilon, delta, unit, sampling, fixed, bound, previous, **overrides)[:2]


def budget_state(results, epsilon, delta=1e-4, unit="user", sampling="uls", fixed=1.0, bound=None, previous=None,
                 **overrides):
    settings = {**SMALL, **overrides}
    return app.budget_view(results, epsilon, delta, unit, sampling, settings["users"],
                           settings["examples_per_user"], settings["examples_per_step"], settings["steps"], fixed,
                           bound, previous=previous)


def table_text(table: str) -> str:
    """The budget table's HTML as its text (cells separated by spaces)."""
    return " ".join(re.sub(r"<[^>]+>", " ", table).split())


def warning_line(headline: str) -> str:
    lines = [line for line in headline.split("\n") if line.startswith("**⚠️")]
    assert len(lines) == 1, headline
    return lines[0]


def test_build_app_constructs(results, tmp_path):
    import gradio as gr

    assert isinstance(app.build_app(results), gr.Blocks)
    assert isinstance(app.build_app(tmp_path / "does-not-exist"), gr.Blocks)


def test_budget_shows_the_planners_numbers(results):
    from hf_dp import mechanism_table

    headline, table = budget(results, 8.0)
    rows = mechanism_table.compare(users=200, examples_per_user=2, examples_per_step=40, steps=20, target_epsilon=8.0,
                                   target_delta=1e-4, noise_multiplier=1.0)
    uls = next(r for r in rows if r["mechanism"] == "uls")
    assert sigma_of(headline) == pytest.approx(uls["noise_multiplier"], rel=1e-3)
    assert f"G = {uls['contribution_bound']}" in headline
    assert MECHANISMS["uls"].name in headline
    # expected_batch_size in the unit the mechanism samples, the same words as the Train tab's box
    assert f"expected_batch_size = {uls['expected_batch_size']:.4g} users per step" in headline
    assert "users per step" in training.batch_size_label("uls")
    for key in ("uls", "els", "example"):  # one column per mechanism, labelled from MECHANISMS
        assert MECHANISMS[key].label in table
    assert "expected_batch_size" in table and "σ needed" in table
    assert f"{uls['noise_multiplier']:.4g}" in table_text(table)
    # more privacy needs more noise; ELS is planned too
    assert sigma_of(budget(results, 1.0)[0]) > sigma_of(headline)
    els_headline, _ = budget(results, 8.0, sampling="els")
    els = next(r for r in rows if r["mechanism"] == "els")
    assert sigma_of(els_headline) == pytest.approx(els["noise_multiplier"], rel=1e-3)
    assert f"expected_batch_size = {els['expected_batch_size']:.4g} examples per step" in els_headline
    assert "examples per step" in training.batch_size_label("els")
    example_headline, _ = budget(results, 8.0, unit="example")
    assert "not protected as a whole" in example_headline


def test_example_level_delta_not_below_one_over_examples_says_lower_delta(results):
    """δ in [1/examples, 1/users): the user-level rows are planned, the example-level one says to lower δ."""
    headline, table = budget(results, 8.0, delta=3e-3, unit="example")  # 400 examples: 1/examples = 2.5e-3
    line = warning_line(headline)
    assert "target_delta" in line and "1/examples" in line and "lower target_delta" in line
    assert "0.0025" in line and "got 0.003" in line and "Raise" not in line and "target_epsilon" not in line
    assert table and "not below 1/examples" in table  # the other mechanisms' columns still show, the note under
    assert "σ =" in budget(results, 8.0, delta=3e-3)[0]  # ULS is fine at this δ


@pytest.mark.parametrize("row, expected, absent", [
    (dict(mechanism="example", delta=3e-3, examples_used=400, sample_rate=0.1), "lower target_delta", "Raise"),
    (dict(mechanism="uls", delta=1e-5, examples_used=400, sample_rate=1.5, expected_batch_size=300,
          sampled_unit="users"), "lower examples_per_step", "Raise"),
    (dict(mechanism="els", delta=1e-5, examples_used=400, sample_rate=0.1, note="too few steps"),
     "Raise target_epsilon", "target_delta"),
])
def test_impossible_budget_says_what_to_change(row, expected, absent):
    message = budget_tab.impossible_budget(row, 0.5)
    assert message.startswith("Impossible budget") and expected in message and absent not in message
    assert "\n" not in message


def test_budget_reads_the_accuracy_cost_from_finished_runs(results, tmp_path):
    headline, _ = budget(results, 8.0)
    assert "Measured accuracy at ε = 8:** 0.700" in headline  # the uls-eps8 run (target 8)
    assert "interpolated" not in headline.split("Cost")[0]  # measured there, not interpolated
    assert "Cost of privacy" in headline and "0.800" in headline  # against the non-private run
    between, _ = budget(results, 2.0)
    assert "Measured accuracy at ε = 2:** 0.567" in between and "interpolated in log ε" in between
    empty, _ = budget(tmp_path, 8.0)
    assert "no finished DP runs" in empty and "hf-dp demo" in empty
    assert "σ =" in empty  # the planner's numbers do not need runs


def test_expected_accuracy_cost_interpolates_in_log_epsilon(results):
    runs = app.list_runs(results)
    cost = app.expected_accuracy_cost(runs, math.sqrt(8.0), "uls")  # halfway between ε=1 and ε=8 in log ε
    assert cost["expected_result"] == pytest.approx(0.60)
    assert cost["mechanism_used"] == "uls"
    assert cost["cost"] == pytest.approx(0.20) and cost["baseline_result"] == pytest.approx(0.40)
    assert cost["non_private_result"] == pytest.approx(0.80)
    assert cost["measured"] and cost["interpolated"]
    assert app.expected_accuracy_cost(runs, 1.0, "uls")["expected_result"] == pytest.approx(0.50)  # measured
    assert not app.expected_accuracy_cost(runs, 1.0, "uls")["interpolated"]
    for outside in (0.5, 0.99, 16.0):  # below or above the measured ε: nothing was measured there
        low = app.expected_accuracy_cost(runs, outside, "uls")
        assert low["expected_result"] is None and not low["measured"] and low["cost"] is None
        assert low["points"] == [(1.0, 0.50), (8.0, 0.70)]
    assert app.expected_accuracy_cost(runs, 8.0, "example")["mechanism_used"] == "any DP mechanism"
    assert app.expected_accuracy_cost([], 8.0, "uls") is None


def test_expected_cost_reads_baseline_and_non_private_results_from_the_dp_runs(results):
    """Without a public-only or non-private run, the figures the DP run's JSON records are used."""
    lm = [r for r in app.list_runs(results) if r.name == "lm-uls-eps8"]
    cost = app.expected_accuracy_cost(lm, 8.0, "uls")
    assert cost["metric_name"] == "perplexity" and cost["lower_is_better"]
    assert cost["baseline_result"] == pytest.approx(35.0) and cost["non_private_result"] == pytest.approx(28.0)
    assert cost["cost"] == pytest.approx(2.0)  # perplexity: expected − non-private


@pytest.mark.parametrize("settings, expected", [
    (dict(delta=0.5), "delta"),
    (dict(delta=None), "Set target_delta"),
    (dict(epsilon=-1.0), "target_epsilon"),
    (dict(epsilon=None), "Set target_epsilon"),
    (dict(examples_per_user=2.5), "examples_per_user = 2.5: use a whole number ≥ 1"),
    (dict(examples_per_step=10_000), "examples_per_step"),
    (dict(examples_per_step=0), "examples_per_step"),
    (dict(users=0), "users = 0: use a whole number ≥ 1"),  # gradio's minimum=1 used to refuse it in a toast
    (dict(users=1), "users=1"),
    (dict(users=-5), "users = -5: use a whole number ≥ 1"),
    (dict(steps=0), "steps = 0: use a whole number ≥ 1"),
    (dict(users=None), "Set users"),
    (dict(bound=0), "contribution_bound = 0: use a whole number ≥ 1"),
    (dict(bound=1.5), "contribution_bound = 1.5"),
])
def test_budget_errors_are_one_line_of_text_and_clear_the_table(results, settings, expected):
    """Out-of-range input: one error line in the page, and no table (the last one is not left on screen)."""
    settings = dict(settings)
    epsilon = settings.pop("epsilon", 8.0)
    headline, table, state = budget_state(results, epsilon, **settings)
    assert headline.startswith("**⚠️") and expected in headline, headline
    assert headline.count("⚠️") == 1 and "\n" not in headline and "Traceback" not in headline
    assert table == "" and state is None


def test_compare_defaults_to_the_first_dp_run(results):
    assert "uls-eps1" in app.compare_view(results, None, "some text")["header"]


def test_compare_classification_run(results):
    out = app.compare_view(results, "uls-eps8", "Once more unto the breach, dear friends")
    assert out["error"] == "" and not out["language_model"] and out["columns"] == []
    for side in ("baseline", "dp"):
        assert set(out[side]) == set(LABELS)
        assert sum(out[side].values()) == pytest.approx(1.0, abs=1e-5)
    assert "uls-eps8" in out["header"] and "DP" in out["header"]


def test_compare_causal_lm_run_generates_side_by_side(results):
    """A plain causal LM: its prompt as plain text; the base model and the run (no non-private causal LM here)."""
    out = app.compare_view(results, "lm-uls-eps8", "once more unto the")
    assert out["error"] == "" and out["language_model"] and out["baseline"] is None
    baseline, dp = out["columns"]
    assert "Public-only baseline" in baseline["heading"] and "no private data" in baseline["heading"]
    assert "test perplexity 35.000 (lower is better)" in baseline["heading"]  # the run's baseline_result
    assert "`lm-uls-eps8`" in dp["heading"] and "ε = 7.9" in dp["heading"] and "perplexity 30.000" in dp["heading"]
    assert baseline["text"] and dp["text"] and "⚠️" not in baseline["heading"] + dp["heading"]
    assert "plain text" in out["decoding"] and "seed 0" in out["decoding"]


@pytest.fixture(scope="module")
def chat_results(tmp_path_factory):
    return make_chat_results_dir(tmp_path_factory.mktemp("chat"))


def test_compare_chat_run_shows_baseline_dp_and_non_private(chat_results):
    out = app.compare_view(chat_results, None, "once more unto the breach", app.Decoding(seed=3, max_new_tokens=8))
    assert out["error"] == "" and out["language_model"]
    assert "chat template" in out["decoding"] and "seed 3" in out["decoding"] and "8 new tokens" in out["decoding"]
    assert CHAT_SYSTEM_PROMPT in out["decoding"]  # the runs' system prompt goes first, as in training
    baseline, dp, non_private = out["columns"]
    assert "no private data" in baseline["heading"] and "completion perplexity 40.000" in baseline["heading"]
    assert MECHANISMS["uls"].label in dp["heading"] and "ε = 7.90, δ = 1e-05 (user-level)" in dp["heading"]
    assert "completion perplexity 31.000 (lower is better)" in dp["heading"]
    assert "no privacy guarantee" in non_private["heading"] and "25.000" in non_private["heading"]
    assert all(column["text"] for column in out["columns"])
    # the same seed gives the same texts; another seed, other samples (the models differ: so do their texts)
    again = app.compare_view(chat_results, "uls-eps8", "once more unto the breach", app.Decoding(seed=3,
                                                                                               max_new_tokens=8))
    assert again["columns"] == out["columns"]
    assert len({column["text"] for column in out["columns"]}) > 1
    # the non-private run compared: baseline and it, no third column
    assert len(app.compare_view(chat_results, "non-private", "once more")["columns"]) == 2


def test_chat_prompt_goes_through_the_chat_template():
    tokenizer = make_chat_tokenizer()
    chat = compare.prompt_inputs(tokenizer, "once more", chat=True)["input_ids"][0].tolist()
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "once more"}], add_generation_prompt=True,
                                             tokenize=False)
    assert rendered.startswith("[CLS] user once more [SEP]") and rendered.rstrip().endswith("[CLS] assistant")
    assert chat == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    with_system = compare.prompt_inputs(tokenizer, "once more", chat=True, system_prompt="the king")
    assert tokenizer.decode(with_system["input_ids"][0]).startswith("[CLS] [UNK] the king [SEP] [CLS] [UNK] once more")
    plain = compare.prompt_inputs(tokenizer, "once more", chat=False)["input_ids"][0].tolist()
    assert tokenizer.decode(plain) == "once more"
    with pytest.raises(app.AppError, match="no chat template"):
        compare.prompt_inputs(make_tokenizer(), "once more", chat=True)


def test_generation_is_seeded_and_leaves_the_global_rng_alone():
    import torch

    tokenizer = make_chat_tokenizer()
    model = tiny_chat_lm(0, len(tokenizer)).eval()
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    texts = {seed: compare.generate_text(model, tokenizer, "king", chat=True,
                                         decoding=app.Decoding(seed=seed, max_new_tokens=12)) for seed in (0, 1)}
    assert torch.rand(1) == expected_next  # the seeded generation did not move the caller's RNG
    assert texts[0] == compare.generate_text(model, tokenizer, "king", chat=True,
                                             decoding=app.Decoding(seed=0, max_new_tokens=12))
    assert texts[0] != texts[1]
    greedy = [compare.generate_text(model, tokenizer, "king", chat=True,
                                    decoding=app.Decoding(seed=seed, temperature=0)) for seed in (0, 1)]
    assert greedy[0] == greedy[1]  # temperature 0: greedy, whatever the seed


@pytest.mark.parametrize("fields, match", [
    (dict(seed=-1), "seed=-1: use a whole number >= 0"),
    (dict(seed=1.5), "seed=1.5"),
    (dict(max_new_tokens=0), "max_new_tokens=0"),
    (dict(max_new_tokens=10_000), "max_new_tokens=10000: use at most 200"),
    (dict(temperature=-0.1), "temperature=-0.1"),
    (dict(temperature=None), "temperature=None"),
    (dict(top_p=0), "top_p=0"),
    (dict(top_p=1.5), "top_p=1.5"),
])
def test_decoding_refuses_bad_values(fields, match):
    with pytest.raises(app.AppError, match=re.escape(match)):
        app.Decoding(**fields)


def test_a_train_tab_run_is_compared_with_the_studys_non_private_run(chat_results, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(chat_results, copy)
    shutil.copytree(copy / "models" / "uls-eps8", copy / app.APP_RUNS_DIR / "models" / "app-uls")
    result = json.loads((copy / "uls-eps8.json").read_text())
    result.update(run="app-uls", model_dir="models/app-uls", baseline_result=41.0)
    (copy / app.APP_RUNS_DIR / "app-uls.json").write_text(json.dumps(result))
    baseline, dp, non_private = app.compare_view(copy, f"{app.APP_RUNS_DIR}/app-uls", "king")["columns"]
    assert "41.000" in baseline["heading"]  # the app run's baseline_result, on its own test rows
    assert f"`{app.APP_RUNS_DIR}/app-uls`" in dp["heading"] and dp["text"]
    assert "`non-private`" in non_private["heading"] and "on its own test rows" in non_private["heading"]


def test_a_missing_model_is_one_line_in_its_column(chat_results, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(chat_results, copy)
    shutil.rmtree(copy / "models" / "non-private")
    out = app.compare_view(copy, "uls-eps8", "king")
    assert out["error"] == ""
    baseline, dp, non_private = out["columns"]
    assert baseline["text"] and dp["text"] and non_private["text"] == ""
    message = non_private["heading"].splitlines()[-1]
    assert message.startswith("**⚠️") and "does not exist" in message and "Traceback" not in non_private["heading"]
    result = json.loads((copy / "uls-eps8.json").read_text())
    result["config"]["model_name_or_path"] = str(tmp_path / "gone")
    (copy / "uls-eps8.json").write_text(json.dumps(result))
    baseline = app.compare_view(copy, "uls-eps8", "king")["columns"][0]
    assert baseline["text"] == "" and "base model folder" in baseline["heading"]


@pytest.mark.parametrize("run, text, expected", [
    ("baseline", "some text", "public-only baseline"),
    ("uls-eps8", "   ", "Type or pick a text"),
    ("no-such-run", "text", "No run named"),
])
def test_compare_errors_are_text(results, run, text, expected):
    out = app.compare_view(results, run, text)
    assert out["error"].startswith("**⚠️") and expected in out["error"] and "\n" not in out["error"]


def test_no_results_yet_is_said_in_the_page(tmp_path):
    assert "No finished runs" in app.compare_view(tmp_path, "uls-eps8", "text")["error"]
    assert "No finished runs" in app.results_overview_markdown(tmp_path)
    assert "No finished runs" in app.privacy_card_markdown(tmp_path, None)
    assert app.privacy_utility_figure(app.list_runs(tmp_path)) is None


def test_results_tab_plot_and_card(results):
    runs = app.list_runs(results)
    assert {r.name for r in runs} >= {"baseline", "non-private", "uls-eps1", "uls-eps8", "els-eps8", "lm-uls-eps8"}
    figure = app.privacy_utility_figure(runs)
    lines = {line.get_label(): line for line in figure.axes[0].get_lines()}
    for key in ("uls", "els"):  # labels, markers and colors from MECHANISMS
        line = lines[MECHANISMS[key].label]
        assert line.get_marker() == MECHANISMS[key].marker and line.get_color() == MECHANISMS[key].color
    assert any(label.startswith(MECHANISMS["public-only"].label) for label in lines)
    assert any(label.startswith(MECHANISMS["non-private"].label) for label in lines)
    card = app.privacy_card_markdown(results, "uls-eps8")
    assert not card.startswith("---") and "Privacy guarantee" in card and "7.90" in card
    assert "no privacy card" in app.privacy_card_markdown(results, "baseline")
    overview = app.results_overview_markdown(results)
    assert "uls-eps8" in overview and "∞" in overview
    assert overview.splitlines()[0] == "| run | mechanism | ε | δ | eval_result | baseline_result |"
    assert MECHANISMS["els"].label in overview and MECHANISMS["public-only"].label in overview


def test_runs_are_named_by_the_vocabulary(results):
    runs = {r.name: r for r in app.list_runs(results)}
    assert runs["baseline"].is_baseline and runs["baseline"].mechanism == "public-only"
    assert [r.mechanism for r in app.list_runs(results)][:2] == ["public-only", "non-private"]
    assert MECHANISMS["els"].label in runs["els-eps8"].label()
    # the baseline key is exactly "public-only": no aliases
    alias = app.RunRecord({**runs["baseline"].result, "mechanism": "baseline"}, runs["baseline"].folder)
    assert not alias.is_baseline


def test_the_app_keeps_no_mechanism_table_of_its_own():
    """Labels, names, markers and colors come from hf_dp.vocabulary; the old words are gone."""
    folder = Path(app.__file__).parent
    source = "\n".join(path.read_text() for path in sorted(folder.glob("*.py")))
    for word in ("METHOD_NAMES", "DP_METHODS", "BASELINE_METHODS", "public-baseline", "baseline_metric",
                 "units_per_step", "tab:blue", "user-level DP, ULS"):
        assert word not in source, word
    assert not re.search(r"def mechanism_of|\bmethods?\b", source)


def test_training_job_reports_progress_and_epsilon():
    from transformers import TrainerControl, TrainerState, TrainingArguments

    def fake_run(settings, results_dir, callbacks):
        state, control = TrainerState(max_steps=settings.max_steps), TrainerControl()
        args = TrainingArguments("unused", report_to=[])
        for callback in callbacks:
            callback.on_train_begin(args, state, control)
        for step in range(1, settings.max_steps + 1):
            state.global_step = step
            for callback in callbacks:
                callback.on_step_end(args, state, control)
                callback.on_log(args, state, control, logs={"loss": 1.0 / step, "dp/epsilon": 0.5 * step})
        return {"run": "fake", "mechanism": "uls", "epsilon": 2.0, "delta": 1e-5, "eval_result": 0.6,
                "baseline_result": 0.4, "metric_name": "accuracy"}

    job = app.TrainingJob(run_fn=fake_run)
    job.start(app.TrainingSettings(mechanism="uls", target_epsilon=8.0, max_steps=4), "unused")
    job.thread.join(timeout=10)
    state = job.poll()
    assert state["status"] == "done" and state["step"] == 4 and state["epsilon"] == pytest.approx(2.0)
    html = app.progress_html(state)
    assert "step 4/4" in html and "ε spent 2.00 of 8" in html
    status = training.job_status_markdown(state)
    assert "fake" in status and "accuracy 0.600" in status and "baseline 0.400" in status

    def failing_run(settings, results_dir, callbacks):
        raise ValueError("target_epsilon=0.01 cannot be reached\nwith these settings")

    job = app.TrainingJob(run_fn=failing_run)
    job.start(app.TrainingSettings(), "unused")
    job.thread.join(timeout=10)
    message = training.job_status_markdown(job.poll())
    assert message.startswith("**⚠️ Training failed") and "\n" not in message


def test_results_plot_of_a_chat_study_is_its_test_nll(chat_results, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(chat_results, copy)
    adaptive = json.loads((copy / "uls-eps8.json").read_text())
    adaptive.update(run="uls-eps8-adaptive", eval_result=30.0)
    adaptive["config"]["adaptive_clipping"] = True
    (copy / "uls-eps8-adaptive.json").write_text(json.dumps(adaptive))
    ax = app.privacy_utility_figure(app.list_runs(copy)).axes[0]
    assert "NLL" in ax.get_ylabel() and "lower is better" in ax.get_ylabel()
    lines = {line.get_label(): line for line in ax.get_lines()}
    uls = MECHANISMS["uls"].label
    assert lines[uls].get_ydata()[0] == pytest.approx(math.log(31.0))
    assert lines[f"{uls}, adaptive clipping"].get_ydata()[0] == pytest.approx(math.log(30.0))
    assert lines[f"{uls}, adaptive clipping"].get_linestyle() == "--"
    for key, value in (("public-only", 40.0), ("non-private", 25.0)):
        line = next(line for label, line in lines.items() if label.startswith(MECHANISMS[key].label))
        assert line.get_ydata()[0] == pytest.approx(math.log(value))


@pytest.mark.parametrize("mechanism, private", [("uls", True), ("els", True), ("non-private", False)])
def test_the_chat_run_trains_with_the_settings_picked(monkeypatch, mechanism, private):
    """The Train tab's task, mechanism, ε and users per step are the DPSFTTrainer's arguments; the plan is checked on
    the loaded data before run_chat_sft (which loads the model) gets that data; only the adapter is saved."""
    from hf_dp.sft import DPSFTConfig
    from hf_dp.workflows import pretrained
    from hf_dp.workflows.tasks import chat_sft

    calls = []
    monkeypatch.setattr(training, "load_data", lambda prepared: "the data")
    monkeypatch.setattr(training, "check_plan", lambda prepared, data: calls.append(("check", data)))
    monkeypatch.setattr(chat_sft, "run_chat_sft", lambda config, args, data, callbacks:
                        calls.append(("run", config, args, data)) or {})
    monkeypatch.setattr(pretrained, "smollm2_path", lambda: "/models/smollm2")
    settings = app.TrainingSettings(task="chat-sft", mechanism=mechanism, target_epsilon=3.0, max_train_users=32,
                                    max_steps=5, expected_batch_size=6)
    app.run_app_training(settings, "some/results", [])
    assert calls[0] == ("check", "the data")
    _, config, args, data = calls[1]
    assert data == "the data" and config.save_adapter_only
    assert config.model_name_or_path == "/models/smollm2" and config.max_train_users == 32
    assert config.results_dir == f"some/results/{app.APP_RUNS_DIR}" and config.run.startswith(f"app-chat-{mechanism}")
    assert args.max_steps == 5 and args.max_length == config.max_length
    if not private:
        assert not isinstance(args, DPSFTConfig)
    else:
        assert isinstance(args, DPSFTConfig) and args.mechanism == mechanism
        assert (args.target_epsilon, args.expected_batch_size) == (3.0, 6)


def test_training_settings_take_mechanism_keys():
    with pytest.raises(app.AppError, match="mechanism='ULS'"):
        app.TrainingSettings(mechanism="ULS")
    assert "not used without DP" in training.batch_size_label("non-private")
    state = {"status": "training", "mechanism": "non-private", "step": 1, "max_steps": 2}
    assert "no privacy guarantee" in app.progress_html(state)


@pytest.mark.slow
def test_training_with_callbacks_end_to_end(tmp_path):
    """The Train tab's callback on a real run (tiny model, tiny user data set): steps and ε arrive in the queue."""
    import queue

    from hf_dp.workflows.tasks.classification import ClassificationConfig, run_classification

    tokenizer = make_tokenizer()
    base = tmp_path / "base"
    tiny_classifier(0, len(tokenizer)).save_pretrained(base)
    tokenizer.save_pretrained(base)
    words = ["king crown england war", "love lady jest music", "death blood spot damned"]
    rows = [{"user_id": f"u{u}", "text": f"{words[u % 3]} {'the ' * (i % 3)}", "label": LABELS[u % 3]}
            for u in range(40) for i in range(1 + u % 3)]
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    config = ClassificationConfig(run="tiny-uls", results_dir=str(tmp_path / "results"), dataset=str(data),
                                  model_name_or_path=str(base), use_lora=False, max_length=16, progress=False)
    training_args = config.training_arguments("uls", target_epsilon=8.0, max_steps=2, expected_batch_size=8,
                                              contribution_bound=2, per_device_train_batch_size=16, noise_seed=0,
                                              logging_steps=1)
    events: queue.Queue = queue.Queue()
    result = run_classification(config, training_args, callbacks=[training.queue_callback_class()(events)])
    seen = []
    while not events.empty():
        seen.append(events.get())
    epsilons = [fields["epsilon"] for event, fields in seen if "epsilon" in fields]
    assert epsilons and epsilons[-1] == pytest.approx(result["epsilon"], rel=0.05)
    assert max(fields["step"] for _, fields in seen) == 2
    runs = app.list_runs(tmp_path / "results")
    assert "tiny-uls" in {r.name for r in runs}
    out = app.compare_view(tmp_path / "results", "tiny-uls", "king crown")
    assert out["error"] == "" and set(out["dp"]) == set(LABELS)


# ---- bad inputs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, match", [
    (dict(max_steps=0), "max_steps=0: use a whole number >= 1"),  # used to train 2 steps (epochs instead)
    (dict(max_steps=-3), "max_steps=-3: use a whole number >= 1"),
    (dict(max_steps=2.5), "max_steps=2.5: use a whole number >= 1"),
    (dict(max_steps=float("nan")), "max_steps=nan: use a whole number >= 1"),
    (dict(max_train_users=1), "max_train_users=1: use a whole number >= 2"),
    (dict(max_eval_examples=0), "max_eval_examples=0: use a whole number >= 1"),
    (dict(target_epsilon=0), "target_epsilon=0: use a finite number > 0"),  # no longer silently 8
    (dict(target_epsilon=float("nan")), "target_epsilon=nan: use a finite number > 0"),
    (dict(target_epsilon=None), "target_epsilon=None: use a finite number > 0"),  # an empty box
    (dict(expected_batch_size=0), "expected_batch_size=0: use a whole number >= 1"),
])
def test_training_settings_refuse_bad_numbers(fields, match):
    with pytest.raises(app.AppError, match=re.escape(match)):
        app.TrainingSettings(**fields)


def test_training_settings_take_form_values():
    settings = app.TrainingSettings(max_steps=8.0, max_train_users=96.0, expected_batch_size=24.0)
    assert (settings.max_steps, settings.max_train_users, settings.expected_batch_size) == (8, 96, 24)
    assert all(isinstance(v, int) for v in (settings.max_steps, settings.max_train_users))
    # a non-private run uses neither ε nor expected_batch_size: empty boxes are fine there
    app.TrainingSettings(mechanism="non-private", target_epsilon=None, expected_batch_size=None)


def test_the_train_tab_shows_a_bad_number_and_starts_nothing(results):
    started = []
    job = app.TrainingJob(run_fn=lambda *args: started.append(args))
    demo = app.build_app(results, training_job=job)
    functions = demo.fns.values() if isinstance(demo.fns, dict) else demo.fns
    on_start = next(f.fn for f in functions if getattr(f, "name", None) == "on_start")
    for values, match in ((("chat-sft", "uls", 8.0, 96, 0, 24), "“max_steps” = 0: use a whole number >= 1"),
                          (("classification", "uls", float("nan"), 96, 8, 24), "“target_epsilon (ε)” = nan"),
                          (("chat-sft", "uls", None, 96, 8, 24), "“target_epsilon (ε)” = None"),
                          (("chat-sft", "uls", 8.0, 1, 8, 24), "“training users (subset)” = 1"),
                          (("chat-sft", "els", 8.0, 96, 8, 0), "“expected_batch_size (examples per step)” = 0"),
                          (("chat-sft", "uls", 8.0, 96, 2.5, 24), "“max_steps” = 2.5"),
                          (("poetry", "uls", 8.0, 96, 8, 24), "“task” = 'poetry'")):
        _, _, status, _ = on_start(*values)  # the notice: one line (no toast beside it), in the form's words
        assert status.startswith("**⚠️") and match in status and "\n" not in status, status
        assert "--" not in status and "=0" not in status
    assert job.thread is None and not started


@pytest.mark.parametrize("epsilon", [float("nan"), float("inf"), 0.0, -1.0, None, "8"])
def test_expected_accuracy_cost_refuses_a_bad_epsilon(results, epsilon):
    with pytest.raises(ValueError, match=re.escape(f"target_epsilon={epsilon!r}: use a finite number > 0")):
        app.expected_accuracy_cost(app.list_runs(results), epsilon, "uls")
    with pytest.raises(ValueError, match="mechanism='ULS'"):
        app.expected_accuracy_cost(app.list_runs(results), 8.0, "ULS")


def test_budget_refuses_a_nan_count(results):
    headline, table = budget(results, 8.0, steps=float("nan"))
    assert headline.startswith("**⚠️") and "steps = nan: type a number" in headline and table == ""


def test_cli_parser_defaults():
    args = app.build_parser().parse_args([])
    assert (args.results_dir, args.port, args.host, args.share) == ("results", 7860, "127.0.0.1", False)
    for flag in ("--results_dir", "--results-dir"):  # the field spelling, the dash spelling as alias
        assert app.build_parser().parse_args([flag, "elsewhere"]).results_dir == "elsewhere"


# ---- Budget: fast, the study's defaults, readable, honest about what was measured ---------------------------


def test_the_planner_is_called_once_per_distinct_budget(monkeypatch):
    """A repeated budget (the slider moved back, another box changed and changed back) answers from memory."""
    from hf_dp import mechanism_table

    calls = []
    real = mechanism_table.compare
    monkeypatch.setattr(mechanism_table, "compare", lambda **kw: calls.append(kw) or real(**kw))
    budget_tab._planned.cache_clear()
    settings = dict(target_delta=1e-4, users=200, examples_per_user=2, examples_per_step=40, steps=20,
                    contribution_bound=1)
    first = budget_tab.plan_budget(target_epsilon=8.0, **settings)
    first[0]["noise_multiplier"] = -1.0  # a caller's edit does not reach the memo
    again = budget_tab.plan_budget(target_epsilon=8.0, users=200.0, **{k: v for k, v in settings.items()
                                                                        if k != "users"})
    assert len(calls) == 1 and again[0]["noise_multiplier"] > 0
    budget_tab.plan_budget(target_epsilon=4.0, **settings)
    assert len(calls) == 2


def test_the_budget_tab_opens_on_the_studys_budget(tmp_path, results):
    from hf_dp import mechanism_table
    from hf_dp.workflows.study_settings import SFT_SETTINGS

    # no study run yet: the chat study's settings and data (817 roles, δ = 1/(10·users) = 1.2e-4)
    empty = app.study_budget_defaults(tmp_path)
    dp = SFT_SETTINGS["dp"]
    assert (empty["users"], empty["target_delta"], empty["examples_per_user"]) == (817, 1.2e-4, 24)
    assert empty["contribution_bound"] == dp["contribution_bound"] and empty["steps"] == dp["max_steps"]
    assert empty["examples_per_step"] == dp["expected_batch_size"] * dp["contribution_bound"]
    assert (empty["privacy_unit"], empty["sampling"], empty["target_epsilon"]) == ("user", "uls", 8.0)
    row = mechanism_table.compare(users=817, examples_per_user=empty["examples_per_user"], examples_per_step=16,
                                  steps=60, target_epsilon=8.0, contribution_bound=1)[0]
    assert row["expected_batch_size"] == dp["expected_batch_size"]  # the study's 16 roles per step
    assert row["sample_rate"] == pytest.approx(16 / 817)
    # a study in the folder: what its ULS run at ε = 8 recorded (its privacy report)
    report = json.loads((results / "uls-eps8.json").read_text())["privacy"]
    study = app.study_budget_defaults(results)
    assert study["users"] == report["num_users"] and study["steps"] == report["steps"]
    assert study["contribution_bound"] == report["contribution_bound"] and study["target_delta"] == report["delta"]
    per_user = round(report["num_examples"] / report["num_users"])
    assert study["examples_per_user"] == per_user
    assert study["examples_per_step"] == report["expected_batch_size"] * min(per_user, report["contribution_bound"])
    assert "uls-eps8" in study["source"]
    # and the page's boxes open on them
    values = {block.elem_id: block.value for block in app.build_app(tmp_path).blocks.values()
              if getattr(block, "elem_id", None) and hasattr(block, "value")}
    assert (values["users"], values["delta"], values["contribution-bound"], values["steps"]) == (817, 1.2e-4, 1, 60)


def test_no_box_has_gradio_bounds_that_would_refuse_in_a_toast(results):
    """gradio refuses a value outside a box's minimum/maximum in a toast and never calls the function, so the last
    table stayed on screen: every number the page takes is checked by the app, which says so in the page."""
    import gradio as gr

    boxes = [b for b in app.build_app(results).blocks.values() if isinstance(b, (gr.Number, gr.Slider))]
    numbers = {b.elem_id for b in boxes if isinstance(b, gr.Number)}
    assert {"users", "steps", "contribution-bound", "train-users", "train-batch", "compare-seed"} <= numbers
    for box in boxes:
        if box.elem_id == "eps-log2":  # the log-ε slider only moves ε within its range; the ε box takes any value
            continue
        assert isinstance(box, gr.Number), box.elem_id
        assert (box.minimum, box.maximum, box.precision) == (None, None, None), box.elem_id


def test_the_budget_table_reads_on_a_phone(results):
    """One column per mechanism, one row per quantity; no number can wrap (the table scrolls sideways instead);
    notes under the table, not in a cell."""
    from html.parser import HTMLParser

    _, table = budget(results, 8.0, delta=3e-3)

    class Cells(HTMLParser):
        def __init__(self):
            super().__init__()
            self.rows, self.nums, self.open_num, self.in_table = [], [], False, False

        def handle_starttag(self, tag, attrs):
            attrs = dict(attrs)
            if tag == "table":
                self.in_table = True
            if tag == "tr":
                self.rows.append([])
            if tag == "span" and attrs.get("class") == "num":
                assert "white-space:nowrap" in attrs.get("style", "")
                self.open_num = True
                self.nums.append("")

        def handle_endtag(self, tag):
            if tag == "span":
                self.open_num = False
            if tag == "table":
                self.in_table = False

        def handle_data(self, data):
            if self.in_table and data.strip() and self.rows:
                self.rows[-1].append(data.strip())
            if self.open_num:
                self.nums[-1] += data

    cells = Cells()
    cells.feed(table)
    assert cells.rows[0] == [MECHANISMS[k].label for k in ("uls", "els", "example")]
    assert all(len(row) == 4 for row in cells.rows[1:]), cells.rows  # a header and three values
    assert any(re.search(r"\d", n) for n in cells.nums) and all(n.strip() for n in cells.nums)
    assert "overflow-x:auto" in table and "not below 1/examples" not in "".join(sum(cells.rows, []))


def test_the_g_change_note_says_why_sigma_rose():
    previous = {"mechanism": "uls", "epsilon": 1.0, "sigma": 1.20, "G": 4, "auto_bound": True, "batch": 20.0,
                "q": 0.1, "noise_std": 0.060, "unit": "users", "settings": ["uls", 1e-4]}
    current = dict(previous, epsilon=2.0, sigma=1.21, G=2, batch=40.0, q=0.2, noise_std=0.030)
    note = budget_tab.g_change_note(previous, current)
    assert note.startswith("**Why σ rose although ε grew:**") and "G = 4" in note and "G = 2" in note
    assert "20 → 40 users per step" in note and "0.06 → 0.03" in note and "contribution_bound" in note
    assert budget_tab.g_change_note(current, previous).startswith("**Why σ fell although ε shrank")
    for other in (dict(current, sigma=1.0),  # σ fell as ε grew: nothing to explain
                  dict(current, G=4),  # the same G
                  dict(current, auto_bound=False),  # G given: it does not change
                  dict(current, settings=["uls", 1e-5])):  # another budget
        assert budget_tab.g_change_note(previous, other) == ""
    assert budget_tab.g_change_note(None, current) == ""


def test_budget_view_says_why_sigma_rises_when_the_recommended_g_changes(results):
    """The planner recommends G = 4 at ε = 1 and G = 2 at ε = 2 for these numbers; σ rises 1.201 → 1.209."""
    _, _, at_1 = budget_state(results, 1.0, fixed=None, users=200, examples_per_user=8, examples_per_step=40,
                              steps=20)
    headline, _, at_2 = budget_state(results, 2.0, fixed=None, users=200, examples_per_user=8, examples_per_step=40,
                                     steps=20, previous=at_1)
    assert (at_1["G"], at_2["G"]) == (4, 2) and at_2["sigma"] > at_1["sigma"]
    assert "**Why σ rose although ε grew:**" in headline and "from G = 4 at ε = 1 to G = 2" in headline
    # G stands beside σ, in the σ line, whether or not the previous view was another ε
    assert re.search(r"\*\*Noise multiplier needed: σ = 1\.2\d* at G = 2\*\* \(G is the planner's pick for this ε",
                     headline)
    assert "set contribution_bound to hold G fixed" in headline
    given, table = budget(results, 2.0, fixed=None, bound=3, users=200, examples_per_user=8, examples_per_step=40,
                          steps=20)
    assert re.search(r"σ = [0-9.]+ at G = 3\*\* \(G given\)", given) and "Why σ" not in given
    assert table.index("σ needed") < table.index("G (rows kept per user)")  # the table's first two rows


def test_nothing_is_expected_where_nothing_was_measured(chat_results):
    """The chat study's one DP run at ε = 8: its result at 8 only, not at every ε."""
    runs = app.list_runs(chat_results)
    assert app.expected_accuracy_cost(runs, 8.0, "uls")["expected_result"] == pytest.approx(31.0)
    for epsilon in (0.5, 2.0, 7.0, 100.0):
        text = budget_tab.cost_markdown(app.expected_accuracy_cost(runs, epsilon, "uls"), epsilon, chat_results,
                                        "uls")
        assert text.startswith(f"**Nothing was measured at ε = {epsilon:.3g}:**") and "ε = 8.00: 31.000" in text
        assert ".;" not in text and ".." not in text  # one full stop between the sentences
        assert "Measured" not in text and "Cost of privacy" not in text and "never extrapolated" in text


# ---- Compare: models kept loaded, a text generated once, column by column, the run's kind only ---------------


@pytest.fixture
def counted(monkeypatch):
    """Counts of model loads and generations in the Compare tab, from an empty cache."""
    compare._MODELS.clear()
    compare._TEXTS.clear()
    counts = {"load": 0, "generate": 0}
    load, generate = compare._load_causal_lm, compare.generate_text

    def counting_load(*args, **kwargs):
        counts["load"] += 1
        return load(*args, **kwargs)

    def counting_generate(*args, **kwargs):
        counts["generate"] += 1
        return generate(*args, **kwargs)

    monkeypatch.setattr(compare, "_load_causal_lm", counting_load)
    monkeypatch.setattr(compare, "generate_text", counting_generate)
    yield counts
    compare._MODELS.clear()
    compare._TEXTS.clear()


def test_compare_keeps_the_three_models_and_generates_each_text_once(chat_results, counted):
    decoding = app.Decoding(seed=1, max_new_tokens=6)
    first = app.compare_view(chat_results, "uls-eps8", "once more", decoding)
    assert (counted["load"], counted["generate"]) == (3, 3)  # baseline, DP, non-private: once each
    again = app.compare_view(chat_results, "uls-eps8", "once more", decoding)
    assert again == first and (counted["load"], counted["generate"]) == (3, 3)  # nothing loaded or generated
    app.compare_view(chat_results, "uls-eps8", "once more", app.Decoding(seed=2, max_new_tokens=6))
    assert (counted["load"], counted["generate"]) == (3, 6)  # another seed: generated again, not loaded again
    app.compare_view(chat_results, "non-private", "once more", decoding)  # its two models are loaded already
    assert counted["load"] == 3


def test_a_model_folder_saved_again_is_loaded_again(chat_results, tmp_path, counted):
    import os
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(chat_results, copy)
    app.compare_view(copy, "uls-eps8", "king", app.Decoding(max_new_tokens=4))
    weights = copy / "models" / "uls-eps8" / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    app.compare_view(copy, "uls-eps8", "king", app.Decoding(max_new_tokens=4))
    assert counted["load"] == 4  # only the rewritten folder


def test_compare_steps_show_each_columns_progress(chat_results, results, counted):
    steps = list(compare.compare_steps(chat_results, "uls-eps8", "king", app.Decoding(max_new_tokens=4)))
    assert len(steps) == 4  # all pending, then after the first and second column, then complete
    statuses = [[c["status"] for c in step["columns"]] for step in steps]
    assert statuses == [["pending"] * 3, ["done", "pending", "pending"], ["done", "done", "pending"], ["done"] * 3]
    assert "⏳ *loading the model, then generating…*" in steps[0]["columns"][0]["heading"]
    assert steps[-1] == app.compare_view(chat_results, "uls-eps8", "king", app.Decoding(max_new_tokens=4))
    again = list(compare.compare_steps(chat_results, "uls-eps8", "king", app.Decoding(max_new_tokens=4)))
    assert len(again) == 3 and "⏳ *generating…*" in again[0]["columns"][1]["heading"]  # known: no all-pending view
    # a classifier's comparison comes in one piece
    assert len(list(compare.compare_steps(results, "uls-eps8", "king"))) == 1


def test_picking_a_run_loads_its_models_in_the_background(chat_results, counted):
    thread = compare.preload(chat_results, "uls-eps8")
    thread.join(timeout=60)
    assert counted["load"] == 3
    app.compare_view(chat_results, "uls-eps8", "king", app.Decoding(max_new_tokens=4))
    assert counted["load"] == 3 and counted["generate"] == 3
    assert compare.preload(chat_results, "baseline") is None  # the public-only baseline has no model of its own


def test_a_chat_run_never_shows_a_classifiers_placeholders(chat_results, results):
    import gradio as gr

    shown = compare.compare_layout(chat_results, None)
    assert shown["language_model"] and shown["error"] == ""
    assert "Public-only baseline" in shown["headings"][0] and "`uls-eps8`" in shown["headings"][1]
    assert "`non-private`" in shown["headings"][2] and not set(shown["headings"]) & set(compare.CLASSIFIER_HEADINGS)
    assert compare.compare_layout(results, "uls-eps8")["headings"][:2] == list(compare.CLASSIFIER_HEADINGS)
    lm = compare.compare_layout(results, "lm-uls-eps8")
    assert lm["language_model"] and lm["headings"][2] == ""  # no non-private causal LM in that folder
    blocks = {b.elem_id: b for b in app.build_app(chat_results).blocks.values() if getattr(b, "elem_id", None)}
    assert not blocks["baseline-label"].visible and not blocks["dp-label"].visible
    assert blocks["baseline-text"].visible and blocks["dp-text"].visible
    assert "no private data" in blocks["baseline-heading"].value
    assert "Fine-tuned model" not in blocks["dp-heading"].value
    assert blocks["compare-text"].label == compare.TEXT_LABELS["chat"] and "class" not in blocks["compare-text"].label
    assert blocks["compare-decoding-settings"].visible
    assert shown["text_label"] == compare.TEXT_LABELS["chat"] and lm["text_label"] == compare.TEXT_LABELS["generative"]
    blocks = {b.elem_id: b for b in app.build_app(results).blocks.values() if getattr(b, "elem_id", None)}
    assert blocks["baseline-label"].visible and not blocks["baseline-text"].visible
    assert blocks["compare-text"].label == compare.TEXT_LABELS["classifier"]
    assert not blocks["compare-decoding-settings"].visible  # a classifier does not decode
    assert isinstance(blocks["baseline-label"], gr.Label)


def test_a_lora_adapter_run_loads_onto_its_base(chat_results, tmp_path, counted):
    """The Train tab keeps a chat run's adapter, not a merged model: Compare merges it in memory, and its text is
    the merged model's."""
    import shutil

    import torch
    from peft import LoraConfig, get_peft_model

    from hf_dp.workflows.runs import save_model

    copy = tmp_path / "copy"
    shutil.copytree(chat_results, copy)
    base_dir = Path(json.loads((copy / "uls-eps8.json").read_text())["config"]["model_name_or_path"])
    tokenizer = make_chat_tokenizer()
    model = get_peft_model(tiny_chat_lm(20, len(tokenizer)), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)  # an adapter that changes the model
    adapter_dir = copy / app.APP_RUNS_DIR / "models" / "app-uls"
    save_model(model, tokenizer, adapter_dir, adapter_only=True)
    files = {f.name for f in adapter_dir.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files and "model.safetensors" not in files
    merged_dir = tmp_path / "merged"
    save_model(model, tokenizer, merged_dir)
    adapter_size = (adapter_dir / "adapter_model.safetensors").stat().st_size
    assert adapter_size * 10 < (merged_dir / "model.safetensors").stat().st_size
    result = json.loads((copy / "uls-eps8.json").read_text())
    result.update(run="app-uls", model_dir="models/app-uls")
    result["config"].update(model_name_or_path=str(base_dir), save_adapter_only=True)
    (copy / app.APP_RUNS_DIR / "app-uls.json").write_text(json.dumps(result))
    decoding = app.Decoding(seed=0, max_new_tokens=8)
    columns = app.compare_view(copy, f"{app.APP_RUNS_DIR}/app-uls", "king", decoding)["columns"]
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    expected = compare.generate_text(merged, tokenizer, "king", chat=True, decoding=decoding,
                                     system_prompt=CHAT_SYSTEM_PROMPT)
    assert columns[1]["text"] == expected and "⚠️" not in columns[1]["heading"]
    assert columns[0]["text"] != expected  # the untouched base says something else


# ---- Train: every setting checked before a model loads, in the form's words; nothing left on failure ---------


def test_errors_name_the_forms_fields():
    message = ("expected_batch_size=100 exceeds the 16 users available: lower --expected_batch_size. Raise "
               "--target_epsilon or --noise_multiplier.")
    words = training.form_error(message, "uls")
    assert words.startswith("“expected_batch_size (users per step)” = 100 exceeds the 16 users available")
    assert "lower “expected_batch_size (users per step)”" in words and "Raise “target_epsilon (ε)”" in words
    assert "noise_multiplier (a setting of the study's recipe, not on this form)" in words and "--" not in words
    assert training.form_error(ValueError("max_train_users=1: use\na whole number >= 2"), "els") == \
        "“training users (subset)” = 1: use a whole number >= 2"
    assert "“expected_batch_size (examples per step)”" in training.form_error("--expected_batch_size", "els")


def chat_prepared(tmp_path, batch: int, truncation_mode: str = "keep_reply", **config_fields) -> training.PreparedRun:
    """A Train-tab chat run over a tiny chat model (no SmolLM2), 16 tokens per conversation."""
    from hf_dp.workflows.tasks.chat_sft import ChatSFTConfig

    model_dir = tmp_path / "tiny-chat"
    if not model_dir.exists():
        tokenizer = make_chat_tokenizer()
        tiny_chat_lm(0, len(tokenizer)).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    settings = app.TrainingSettings(task="chat-sft", mechanism="uls", target_epsilon=8.0, max_steps=2,
                                    expected_batch_size=batch)
    config = ChatSFTConfig(run="t", results_dir=str(tmp_path / app.APP_RUNS_DIR), model_name_or_path=str(model_dir),
                           max_length=16, progress=False, **config_fields)
    arguments = config.training_arguments("uls", target_epsilon=8.0, expected_batch_size=batch, max_steps=2,
                                          contribution_bound=1, use_cpu=True, truncation_mode=truncation_mode)
    return training.PreparedRun(settings, config, arguments)


def chat_data():
    """10 roles; the last 4 only have prompts that fill the 16 tokens, so SFTTrainer keeps no reply of theirs."""
    from datasets import Dataset

    from hf_dp.workflows.tasks.language_modeling import TextData

    def row(user, words):
        return {"user_id": f"u{user}", "prompt": [{"role": "user", "content": words}],
                "completion": [{"role": "assistant", "content": "the king"}]}

    rows = [row(u, "once more" if u < 6 else "the king " * 12) for u in range(10) for _ in range(2)]
    return TextData(train=Dataset.from_list(rows), test=Dataset.from_list(rows[:2]), dataset_name="test")


def test_the_plan_is_checked_on_the_rows_the_trainer_will_see(tmp_path):
    """Chat: with TRL's keep_start cut, the conversations SFTTrainer would drop are dropped before the plan, so a
    batch of 8 of the 6 roles left is refused before any model loads, in the form's words; 4 of 6 is planned. The
    default keep_reply cut keeps every reply: all 10 roles are planned."""
    assert training.check_plan(chat_prepared(tmp_path, 8), chat_data()).num_units == 10
    with pytest.raises(app.AppError) as refused:
        training.check_plan(chat_prepared(tmp_path, 8, "keep_start"), chat_data())
    message = str(refused.value)
    assert "“expected_batch_size (users per step)” = 8 exceeds the 6 users available" in message, message
    assert "--" not in message
    plan = training.check_plan(chat_prepared(tmp_path, 4, "keep_start"), chat_data())
    assert plan.num_units == 6 and plan.sample_rate == pytest.approx(4 / 6) and plan.steps == 2
    non_private = dataclasses_replace(chat_prepared(tmp_path, 4), mechanism="non-private")
    assert training.check_plan(non_private, chat_data()) is None


def dataclasses_replace(prepared, **settings):
    import dataclasses

    return dataclasses.replace(prepared, settings=dataclasses.replace(prepared.settings, **settings))


def classification_data(users: int):
    from types import SimpleNamespace

    from datasets import Dataset

    rows = [{"user_id": f"u{u}", "text": "king crown", "labels": u % 3} for u in range(users) for _ in range(3)]
    return SimpleNamespace(train=Dataset.from_list(rows), test=Dataset.from_list(rows[:3]))


def test_a_batch_the_data_cannot_fill_is_refused_before_any_model_loads(monkeypatch, tmp_path):
    from hf_dp.workflows.tasks import classification

    loaded = []
    monkeypatch.setattr(training, "load_data", lambda prepared: classification_data(5))
    monkeypatch.setattr(classification, "run_classification", lambda *args, **kwargs: loaded.append(args))
    phases = []
    callback = type("Phases", (), {"phase": lambda self, status: phases.append(status)})()
    settings = app.TrainingSettings(task="classification", mechanism="uls", target_epsilon=8.0, max_steps=2,
                                    max_train_users=96, expected_batch_size=24)
    with pytest.raises(app.AppError, match=re.escape("“expected_batch_size (users per step)” = 24 exceeds the 5 "
                                                     "users available")):
        app.run_app_training(settings, tmp_path, [callback])
    assert not loaded and phases == ["checking"]  # no model loaded, no "loading" phase
    assert not (tmp_path / app.APP_RUNS_DIR / "models").exists()


def test_a_failed_run_leaves_no_model_folder(monkeypatch, tmp_path):
    from hf_dp.workflows.tasks import classification

    made = []

    def failing_run(config, arguments, **kwargs):
        folder = Path(arguments.output_dir)
        folder.mkdir(parents=True)
        (folder / "_hf_dp.lock").write_text("")
        made.append(folder)
        raise RuntimeError("the trainer refused the model")

    monkeypatch.setattr(training, "load_data", lambda prepared: classification_data(30))
    monkeypatch.setattr(classification, "run_classification", failing_run)
    settings = app.TrainingSettings(task="classification", mechanism="uls", max_steps=2, expected_batch_size=4)
    with pytest.raises(RuntimeError, match="refused the model"):
        app.run_app_training(settings, tmp_path, [])
    assert made and not made[0].exists() and not list((tmp_path / app.APP_RUNS_DIR).glob("*.json"))
    # a run's name never reuses a folder that is there
    models_dir = tmp_path / app.APP_RUNS_DIR / "models"
    first = training.prepare_run(settings, tmp_path).model_dir
    first.mkdir(parents=True)
    assert training.prepare_run(settings, tmp_path).model_dir != first
    assert first.parent == models_dir


def test_a_failed_run_is_said_in_the_forms_words():
    def refused(settings, results_dir, callbacks):
        raise ValueError("expected_batch_size=100 exceeds the 16 users available: lower --expected_batch_size.")

    job = app.TrainingJob(run_fn=refused)
    job.start(app.TrainingSettings(mechanism="els"), "unused")
    job.thread.join(timeout=10)
    message = training.job_status_markdown(job.poll())
    assert "“expected_batch_size (examples per step)” = 100" in message and "--" not in message


def test_train_tab_runs_are_in_the_results_plot(chat_results, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(chat_results, copy)
    (copy / app.APP_RUNS_DIR).mkdir()
    for run, mechanism, epsilon, metric in (("app-uls", "uls", 3.0, 33.0), ("app-np", "non-private", None, 27.0)):
        result = json.loads((copy / ("uls-eps8.json" if epsilon else "non-private.json")).read_text())
        result.update(run=run, mechanism=mechanism, epsilon=epsilon, eval_result=metric)
        (copy / app.APP_RUNS_DIR / f"{run}.json").write_text(json.dumps(result))
    lines = {line.get_label(): line for line in app.privacy_utility_figure(app.list_runs(copy)).axes[0].get_lines()}
    uls = lines[f"{MECHANISMS['uls'].label}, Train tab (own test rows)"]
    assert list(uls.get_xdata()) == [3.0] and uls.get_ydata()[0] == pytest.approx(math.log(33.0))
    # a shape no study series has (hollow study points of adaptive runs included): the two never read alike
    from hf_dp.workflows.app.plot import TRAIN_TAB_MARKER

    study_markers = {line.get_marker() for label, line in lines.items() if "Train tab" not in label}
    assert uls.get_marker() == TRAIN_TAB_MARKER not in study_markers | {m.marker for m in MECHANISMS.values()}
    assert uls.get_color() == MECHANISMS["uls"].color
    assert f"{MECHANISMS['non-private'].label}, Train tab (own test rows)" in lines
    assert lines[MECHANISMS["uls"].label].get_ydata()[0] == pytest.approx(math.log(31.0))  # the study's, apart
    # the legend is the figure's, under the axes (never over a point), at a size a phone still shows
    figure = app.privacy_utility_figure(app.list_runs(copy))
    (legend,) = figure.legends
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(figure).get_renderer()
    assert figure.axes[0].get_legend() is None and legend.get_texts()[0].get_fontsize() >= 10
    assert legend.get_window_extent(renderer).y1 <= figure.axes[0].get_tightbbox(renderer).y0 + 1
    # a folder with Train-tab runs only has a plot too
    only = tmp_path / "only"
    shutil.copytree(copy / app.APP_RUNS_DIR, only / app.APP_RUNS_DIR)
    figure = app.privacy_utility_figure(app.list_runs(only))
    assert figure is not None and f"{MECHANISMS['uls'].label}, Train tab (own test rows)" in {
        line.get_label() for line in figure.axes[0].get_lines()}


def test_a_train_tab_chat_run_keeps_its_adapter_not_a_merged_model(monkeypatch, tmp_path, counted):
    """A real Train-tab chat run (a tiny chat model, LoRA, 2 DP steps): its folder holds the LoRA adapter, its
    tokenizer, card and ledger, no merged weights, and Compare generates with it merged onto its base."""
    prepared = chat_prepared(tmp_path, 4, use_lora=True, lora_target_modules=["q_proj", "v_proj"],
                             save_adapter_only=True)
    prepared.config.run, prepared.arguments.output_dir = "app-chat-uls", str(
        tmp_path / app.APP_RUNS_DIR / "models" / "app-chat-uls")
    monkeypatch.setattr(training, "load_data", lambda prepared: chat_data())
    result = app.run_app_training(prepared.settings, tmp_path, [], prepared=prepared)
    folder = tmp_path / app.APP_RUNS_DIR / "models" / "app-chat-uls"
    files = {f.name for f in folder.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= files, files
    assert not any(name.startswith("model") and name.endswith(".safetensors") for name in files), files
    base_weights = sum(f.stat().st_size for f in (tmp_path / "tiny-chat").glob("*.safetensors"))
    assert (folder / "adapter_model.safetensors").stat().st_size * 5 < base_weights  # r = 8 on a tiny model
    assert result["config"]["save_adapter_only"] and "library_name: peft" in (folder / "README.md").read_text()
    assert "its LoRA adapter (not a merged model)" in training.job_status_markdown({"status": "done",
                                                                                     "result": result})
    columns = app.compare_view(tmp_path, f"{app.APP_RUNS_DIR}/app-chat-uls", "once more",
                               app.Decoding(max_new_tokens=4))["columns"]
    assert len(columns) == 2 and all(c["status"] == "done" for c in columns), columns


@pytest.mark.parametrize("epsilon", [100.0, 1000.0, 1e6])
def test_budget_tab_refuses_an_epsilon_beyond_the_sampler_in_one_line(results, epsilon):
    """ε = 100 once read "δ = 0.00013 + 2e+08", ε = 1000 "+ ∞": now one line naming the largest ε the sampler can
    state at this plan, and no stale table; ε = 60 is within it."""
    headline, table, state = budget_state(results, epsilon)
    line = warning_line(headline)
    assert headline == line and table == "" and state is None
    assert "beyond what the noise sampler can state" in line and "the largest ε this plan can state" in line
    assert re.search(r"ask for ε ≤ \d+\.\d", line) and "∞" not in line and "e+0" not in line.split("draws")[1]
    within, _ = budget(results, 60.0)
    assert "beyond" not in within and "δ = 0.0001 + " in within


def test_the_budget_opens_on_the_rows_a_user_has_not_those_g_kept(tmp_path):
    """A study run at G = 1 reports one example kept per user; the Budget opens on the rows users have (19)."""
    from hf_dp.workflows.app.budget import study_budget_defaults

    results = make_results_dir(tmp_path / "results")
    path = next(p for p in sorted(results.glob("*.json")) if json.loads(p.read_text()).get("mechanism") == "uls")
    run = json.loads(path.read_text())
    run["privacy"].update(num_users=770, num_examples=770, contribution_bound=1)
    run.update(num_train_users=770, num_train_examples=14630)
    path.write_text(json.dumps(run))
    defaults = study_budget_defaults(results)
    assert (defaults["users"], defaults["examples_per_user"]) == (770, 19)
