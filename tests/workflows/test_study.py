"""`hf-dp demo`: the study's plan, its plot, seeds and their summary; the chat SFT study (the default) and the
causal-LM study (`--task causal_lm`) on a tiny Llama and tiny data, and --quick runs end to end on the real models
(SmolLM2 for the LM studies, MiniLM for `--task classification`)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from hf_dp.vocabulary import MECHANISMS
from hf_dp.workflows import study, study_runs, study_plot, study_settings
from hf_dp.workflows.run_results import RESULT_KEYS, load_result, save_result

ROOT = Path(__file__).resolve().parents[2]



def test_plan_runs_demo_and_grid():
    demo = study_runs.runs_of_study(grid=False, task="classification")
    assert [r.run for r in demo] == ["baseline", "non-private", "uls-eps8-adaptive"]
    assert demo[2] == study_runs.StudyRun("uls-eps8-adaptive", "uls", 8.0, adaptive=True)
    grid = study_runs.runs_of_study(grid=True, task="classification")
    assert {(r.mechanism, r.target_epsilon, r.adaptive) for r in grid} == {
        ("public-only", None, False), ("non-private", None, False), ("example", 8.0, True), ("uls", 8.0, False),
        *{(m, e, True) for m in ("uls", "els") for e in (1.0, 3.0, 8.0)},
    }
    assert [r.run for r in grid[:2]] == ["baseline", "non-private"]  # their numbers go into the DP cards
    assert all(r.mechanism in MECHANISMS for r in grid)
    assert all(r.run.endswith("-adaptive") == r.adaptive for r in grid) and len({r.run for r in grid}) == len(grid)


def test_parser_flags():
    args = study.build_parser().parse_args(["--grid", "--results_dir", "out", "--quick", "--overwrite",
                                            "--num_threads", "1", "--no_progress"])
    assert (args.grid, args.results_dir, args.quick, args.overwrite, args.num_threads, args.no_progress) == (
        True, "out", True, True, 1, True)
    dashes = study.build_parser().parse_args(["--results-dir", "out", "--num-threads", "2", "--no-progress"])
    assert (dashes.results_dir, dashes.num_threads, dashes.no_progress) == ("out", 2, True)
    (defaults,) = study.build_parser().parse([])
    assert (defaults.grid, defaults.results_dir, defaults.quick, defaults.overwrite) == (False, "results", False, False)
    assert (defaults.task, defaults.runs, defaults.seeds) == ("sft", None, 1)  # the chat study is the default
    lm = study.build_parser().parse_args(["--task", "causal_lm", "--runs", "baseline", "uls-eps8"])
    assert (lm.task, lm.runs) == ("causal_lm", ["baseline", "uls-eps8"])
    with pytest.raises(SystemExit):
        study.build_parser().parse_args(["--task", "translation"])


def test_each_run_takes_its_privacy_settings_from_the_training_arguments(tmp_path):
    from hf_dp import DPTrainingArguments

    settings = study_settings.DEMO_SETTINGS
    runs = {entry.run: entry for entry in study_runs.runs_of_study(grid=True, task="classification")}
    configure = dict(examples_per_step=155, baseline_result=0.44, non_private_result=0.47, task="classification")
    baseline, none = study_runs.configure_run(runs["baseline"], settings, str(tmp_path), **configure)
    assert none is None and baseline.baseline_result == 0.44
    # tuned on them: never trained on
    assert sorted(baseline.exclude_train_plays) == sorted(study_settings.TUNING_PLAYS)
    config, uls = study_runs.configure_run(runs["uls-eps8"], settings, str(tmp_path), **configure)
    assert isinstance(uls, DPTrainingArguments) and uls.mechanism == "uls" and uls.target_epsilon == 8.0
    assert (uls.expected_batch_size, uls.contribution_bound, uls.max_steps) == (32, 8, 200)  # users per step
    assert not uls.adaptive_clipping and uls.max_grad_norm == 1.0
    assert config.non_private_result == 0.47  # goes into the DP card and the result JSON
    _, adaptive = study_runs.configure_run(runs["uls-eps8-adaptive"], settings, str(tmp_path), **configure)
    assert (adaptive.adaptive_clipping, adaptive.target_unclipped_quantile, adaptive.clipping_count_noise) == (
        True, 0.5, None)  # σ_b = m/20 of each run's own expected batch: ELS's must exceed its larger σ_eff / 2
    _, els = study_runs.configure_run(runs["els-eps3-adaptive"], settings, str(tmp_path), **configure)
    assert (els.mechanism, els.expected_batch_size, els.target_epsilon) == ("els", 155, 3.0)  # examples per step
    assert els.adaptive_clipping
    _, example = study_runs.configure_run(runs["example-eps8-adaptive"], settings, str(tmp_path), **configure)
    assert (example.mechanism, example.expected_batch_size, example.adaptive_clipping) == ("example", 155, True)
    _, plain = study_runs.configure_run(runs["non-private"], settings, str(tmp_path), **configure)
    assert not isinstance(plain, DPTrainingArguments) and (plain.max_steps, plain.learning_rate) == (400, 2e-3)


def _fake(run, mechanism, eval_result, epsilon=None, target=None):
    privacy = None if epsilon is None or mechanism == "public-only" else {
        "num_users": 1101, "privacy_unit": MECHANISMS[mechanism].privacy_unit, "mechanism": mechanism}
    return {"run": run, "mechanism": mechanism, "target_epsilon": target, "epsilon": epsilon, "delta": 1e-4,
            "privacy": privacy, "metric_name": "accuracy", "eval_result": eval_result, "baseline_result": 0.44,
            "model_dir": None, "base_model": "m", "task": "classification", "train_seconds": 1.0,
            "eval_seconds": 0.5, "config": {}}


def test_plot_privacy_utility_writes_a_png(tmp_path):
    results = [_fake("baseline", "public-only", 0.44, 0.0), _fake("non-private", "non-private", 0.55),
               _fake("uls-eps1", "uls", 0.45, 0.99, 1.0), _fake("uls-eps8", "uls", 0.5, 7.9, 8.0),
               _fake("els-eps8", "els", 0.47, 7.95, 8.0), _fake("example-eps8", "example", 0.52, 7.99, 8.0)]
    path = study_plot.plot_privacy_utility(results, tmp_path / "plot.png", title="t")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_completed_runs_are_skipped(tmp_path):
    """A resumed study trains nothing when every JSON exists, and rebuilds summary and plot from them."""
    adaptive = dict(_fake("uls-eps8-adaptive", "uls", 0.5, 7.9, 8.0), config={"adaptive_clipping": True})
    adaptive["privacy"]["final_max_grad_norm"] = 12.5
    runs = [_fake("baseline", "public-only", 0.44, 0.0), _fake("non-private", "non-private", 0.55), adaptive]
    for result in runs:
        save_result(result, tmp_path)
    logged = []
    summary = study.run_study(str(tmp_path), progress=False, log=logged.append, task="classification")
    assert sum("skipped" in line for line in logged) == 3
    assert [row["run"] for row in summary["table"]] == ["baseline", "non-private", "uls-eps8-adaptive"]
    assert (tmp_path / "privacy_utility.png").is_file()
    table = json.loads((tmp_path / "summary.json").read_text())["table"]
    assert table[2] == {"run": "uls-eps8-adaptive", "mechanism": "uls", "target_epsilon": 8.0, "epsilon": 7.9,
                        "eval_result": 0.5, "train_seconds": 1.0, "adaptive_clipping": True, "max_grad_norm": 12.5,
                        "gap_closed": pytest.approx(0.06 / 0.11)}


def test_a_finished_run_of_other_settings_is_refused_not_reused(tmp_path):
    """`--full` beside the default study's results (same run names, other settings) must not read the default's
    numbers as its own."""
    default = study_settings.SFT_SETTINGS["dp"]
    finished = dict(_fake("uls-eps8-adaptive", "uls", 80.0, 7.99, 8.0), steps=default["max_steps"],
                    config={k: default[k] for k in ("max_steps", "learning_rate", "expected_batch_size")})
    save_result(finished, tmp_path)
    full = study_settings.study_settings("sft", full=True)
    assert (full["dp"]["max_steps"], full["dp"]["expected_batch_size"]) != (default["max_steps"],
                                                                             default["expected_batch_size"])
    with pytest.raises(ValueError, match=r"uls-eps8-adaptive.json was trained with other settings: max_steps"):
        study.run_study(str(tmp_path), full=True, progress=False, log=lambda line: None, runs=["baseline"])


def test_full_study_flags():
    (args,) = study.build_parser().parse(["--full"])
    assert (args.full, args.results_dir, args.task) == (True, "results-full", "sft")
    assert study.build_parser().parse(["--full", "--results_dir", "x"])[0].results_dir == "x"
    for argv, message in ((["--full", "--task", "classification"], "only sft has a full study"),
                          (["--full", "--quick"], "--full and --quick")):
        with pytest.raises(ValueError, match=message):
            study.StudyArguments(**{"full": True, "task": argv[-1] if argv[1] == "--task" else "sft",
                                    "quick": "--quick" in argv})


def test_incomplete_json_is_not_a_result(tmp_path):
    (tmp_path / "uls-eps8.json").write_text('{"run": "uls-eps8"')
    assert load_result(tmp_path / "uls-eps8.json") is None


def test_a_result_whose_figure_is_not_a_number_is_refused_naming_the_file(tmp_path):
    from hf_dp.workflows.run_results import RESULT_KEYS

    result = dict.fromkeys(RESULT_KEYS, None) | {"run": "uls-eps8", "eval_result": 0.5, "baseline_result": 0.4,
                                                 "epsilon": 7.9, "train_seconds": 1.0}
    path = tmp_path / "uls-eps8.json"
    path.write_text(json.dumps(result))
    assert load_result(path)["eval_result"] == 0.5
    path.write_text(json.dumps(dict(result, eval_result="high")))
    with pytest.raises(ValueError, match=r"uls-eps8.json: eval_result is 'high', not a number: .* delete the file"):
        load_result(path)
    from hf_dp.workflows.app.results import list_runs

    assert list_runs(tmp_path) == []  # the app leaves it out (and logs why)


@pytest.mark.slow
def test_quick_demo_writes_results_summary_and_plot(tmp_path):
    """`python -m hf_dp.workflows.study --quick`: every run's JSON with the schema, summary.json, the PNG."""
    command = [sys.executable, "-m", "hf_dp.workflows.study", "--task", "classification", "--quick", "--results_dir",
               str(tmp_path), "--no_progress", "--num_threads", "1"]
    env = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    import os

    completed = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT,
                               env={**os.environ, **env})
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-5000:]
    for run in ("baseline", "non-private", "uls-eps8-adaptive"):
        result = load_result(tmp_path / f"{run}.json")
        assert result is not None and set(RESULT_KEYS) <= set(result), run
        assert result["task"] == "classification" and result["metric_name"] == "accuracy"
        assert result["base_model"] == "sentence-transformers/all-MiniLM-L6-v2"
        assert 0.0 <= result["eval_result"] <= 1.0
    baseline = load_result(tmp_path / "baseline.json")
    uls = load_result(tmp_path / "uls-eps8-adaptive.json")
    nonprivate = load_result(tmp_path / "non-private.json")
    assert baseline["mechanism"] == "public-only" and baseline["epsilon"] == 0.0 and baseline["model_dir"] is None
    assert uls["mechanism"] == "uls" and 0 < uls["epsilon"] <= 8.0 and uls["privacy"]["mechanism"] == "uls"
    assert uls["baseline_result"] == baseline["eval_result"] == nonprivate["baseline_result"]
    assert uls["non_private_result"] == nonprivate["eval_result"] and "non_private_result" not in nonprivate
    assert (uls["config"]["expected_batch_size"], uls["config"]["contribution_bound"]) == (8, 8)
    assert uls["config"]["adaptive_clipping"] is True and uls["privacy"]["max_grad_norm"] > 0
    assert nonprivate["epsilon"] is None and nonprivate["privacy"] is None
    for result in (uls, nonprivate):
        model_dir = tmp_path / result["model_dir"]
        assert (model_dir / "README.md").is_file() and (model_dir / "config.json").is_file()
    card = (tmp_path / uls["model_dir"] / "README.md").read_text()
    assert "Public-only baseline" in card and "Non-private fine-tuning" in card
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [row["run"] for row in summary["table"]] == ["baseline", "non-private", "uls-eps8-adaptive"]
    assert summary["quick"] is True and summary["table"][2]["adaptive_clipping"] is True
    png = (tmp_path / "privacy_utility.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert "uls-eps8-adaptive" in completed.stdout  # the table is printed
    # its last line opens these results in the app, a command that runs as printed
    assert completed.stdout.strip().splitlines()[-1] == (f"Explore them in the app: hf-dp app --results_dir "
                                                         f"{tmp_path}   (then open http://127.0.0.1:7860)")


def test_example_sampling_runs_match_uls_compute():
    # users a (3 rows), b (1 row): with G = 2 a ULS step of 10 users processes 10 x mean(2, 1) = 15 rows
    assert study_runs.matching_examples_per_step(["a", "a", "a", "b"], 10, 2) == 15


# --------------------------------------------------------------------------------------------------------------------
# The causal-LM study (`--task causal_lm`): planned runs, settings, and a tiny end-to-end run on a tiny Llama
# --------------------------------------------------------------------------------------------------------------------


def test_plan_runs_causal_lm_demo_and_grid():
    demo = study_runs.runs_of_study(grid=False, task="causal_lm")
    assert [(r.run, r.mechanism, r.target_epsilon, r.adaptive) for r in demo] == [
        ("baseline", "public-only", None, False), ("non-private", "non-private", None, False),
        ("uls-eps8", "uls", 8.0, False), ("uls-eps8-adaptive", "uls", 8.0, True)]
    grid = study_runs.runs_of_study(grid=True, task="causal_lm")
    assert [r.run for r in grid[:2]] == ["baseline", "non-private"]
    assert {(r.mechanism, r.target_epsilon, r.adaptive) for r in grid[2:]} == {
        (m, e, a) for m in ("uls", "els") for e in (1.0, 3.0, 8.0) for a in (False, True)}
    assert len({r.run for r in grid}) == len(grid) == 14
    assert all(r.run.endswith("-adaptive") == r.adaptive for r in grid)
    with pytest.raises(ValueError, match="task"):
        study_runs.runs_of_study(grid=False, task="translation")


def test_causal_lm_runs_share_compute_and_hold_out_the_tuning_plays(tmp_path):
    from transformers import TrainingArguments

    from hf_dp import DPTrainingArguments
    from hf_dp.workflows.tasks.language_modeling import LanguageModelingConfig

    settings = study_settings.CAUSAL_LM_SETTINGS
    runs = {entry.run: entry for entry in study_runs.runs_of_study(grid=True, task="causal_lm")}
    configure = dict(examples_per_step=16, baseline_result=250.0, non_private_result=150.0, task="causal_lm")
    baseline, none = study_runs.configure_run(runs["baseline"], settings, str(tmp_path), **configure)
    assert none is None and isinstance(baseline, LanguageModelingConfig)
    assert sorted(baseline.exclude_train_plays) == sorted(study_settings.TUNING_PLAYS)
    assert not set(study_settings.TUNING_TRAIN_PLAYS) & set(study_settings.TUNING_EVAL_PLAYS)
    assert len(study_settings.TUNING_PLAYS) == 6
    dp = settings["dp"]
    for name in ("uls-eps8", "uls-eps1", "els-eps3"):
        config, args = study_runs.configure_run(runs[name], settings, str(tmp_path), **configure)
        assert isinstance(args, DPTrainingArguments) and args.mechanism == name[:3]
        assert (args.expected_batch_size, args.contribution_bound, args.max_steps) == (16, 1, dp["max_steps"])
        assert (args.learning_rate, args.max_grad_norm) == (dp["learning_rate"], dp["max_grad_norm"])
        assert config.non_private_result == 150.0 and config.model_dir == tmp_path / "models" / name
        assert not getattr(args, "adaptive_clipping", False)
    _, plain = study_runs.configure_run(runs["non-private"], settings, str(tmp_path), **configure)
    assert not isinstance(plain, DPTrainingArguments) and isinstance(plain, TrainingArguments)
    # same compute: as many speeches per step and as many steps as a DP run (G = 1: one speech per user)
    assert (plain.per_device_train_batch_size, plain.max_steps) == (dp["expected_batch_size"], dp["max_steps"])


def test_adaptive_runs_carry_the_adaptive_fields(tmp_path):
    settings = study_settings.CAUSAL_LM_SETTINGS
    runs = {entry.run: entry for entry in study_runs.runs_of_study(grid=True, task="causal_lm")}
    for name in ("uls-eps8-adaptive", "els-eps1-adaptive"):
        _, args = study_runs.configure_run(runs[name], settings, str(tmp_path), examples_per_step=16, task="causal_lm")
        assert args.adaptive_clipping is True
        assert args.target_unclipped_quantile == settings["adaptive"]["target_unclipped_quantile"]
        assert args.clipping_learning_rate == settings["adaptive"]["clipping_learning_rate"]
        assert args.max_grad_norm == settings["dp"]["max_grad_norm"]  # the initial clipping norm
        assert args.target_epsilon == runs[name].target_epsilon


def test_adaptive_run_with_an_unknown_field_says_so(tmp_path):
    settings = dict(study_settings.CAUSAL_LM_SETTINGS, adaptive={"no_such_field": 1})
    entry = study_runs.StudyRun("uls-eps8-adaptive", "uls", 8.0, adaptive=True)
    with pytest.raises(ValueError, match="no_such_field"):
        study_runs.configure_run(entry, settings, str(tmp_path), examples_per_step=16, task="causal_lm")


def test_gap_closed_on_the_nll_scale():
    def lm(run, mechanism, perplexity):
        return dict(_fake(run, mechanism, perplexity), metric_name="perplexity")

    baseline = lm("baseline", "public-only", math.exp(5.5))
    non_private = lm("non-private", "non-private", math.exp(5.0))
    assert study_plot.gap_closed(lm("uls-eps8", "uls", math.exp(5.25)), baseline, non_private) == pytest.approx(0.5)
    assert study_plot.gap_closed(lm("uls-eps1", "uls", math.exp(5.6)), baseline, non_private) == pytest.approx(-0.2)
    assert study_plot.gap_closed(baseline, baseline, None) is None


def test_causal_lm_plot_writes_a_png(tmp_path):
    def lm(run, mechanism, nll, epsilon=None, adaptive=False):
        return dict(_fake(run, mechanism, math.exp(nll), epsilon, epsilon), metric_name="perplexity",
                    config={"adaptive_clipping": adaptive}, base_model="/cache/smollm2-135m-instruct")

    results = [lm("baseline", "public-only", 5.5, 0.0), lm("non-private", "non-private", 5.0),
               lm("uls-eps1", "uls", 5.45, 0.99), lm("uls-eps8", "uls", 5.3, 7.9),
               lm("uls-eps8-adaptive", "uls", 5.25, 7.9, True), lm("els-eps8", "els", 5.31, 7.95),
               lm("els-eps8-adaptive", "els", 5.27, 7.95, True)]
    path = study_plot.plot_privacy_utility(results, tmp_path / "plot.png", title=study_plot.plot_title(results, False))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


# A tiny Llama saved like a Hub checkpoint, and tiny user-partitioned JSONL data: the study's code paths in seconds.

TINY_WORDS = ("thou art my lord the king good night sweet prince love death fair speak come war crown blood fool "
              "grave").split()


@pytest.fixture(scope="module")
def tiny_lm_study(tmp_path_factory):
    """(settings, folder): settings of a causal-LM study on a tiny Llama (saved with its tokenizer) and JSONL
    train/test files whose users differ."""
    import random

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny-lm-study")
    vocab = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2, **{w: i + 3 for i, w in enumerate(TINY_WORDS)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]",
                                        eos_token="[EOS]")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(vocab), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                         max_position_embeddings=32, pad_token_id=0, eos_token_id=2, bos_token_id=2))
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    rng = random.Random(0)
    for split, users in (("train", [f"u{i}" for i in range(24)]), ("test", [f"t{i}" for i in range(6)])):
        with open(folder / f"{split}.jsonl", "w") as handle:
            for user in users:
                for _ in range(rng.randint(1, 4)):
                    start = rng.randrange(len(TINY_WORDS) - 5)
                    text = " ".join(TINY_WORDS[start:start + rng.randint(3, 5)])
                    handle.write(json.dumps({"user_id": user, "text": text}) + "\n")
    settings = dict(
        config=dict(model_name_or_path=str(folder / "model"), dataset=str(folder / "train.jsonl"),
                    eval_dataset=str(folder / "test.jsonl"), max_length=8, use_lora=True, lora_r=2, lora_alpha=4,
                    lora_target_modules=["q_proj", "v_proj"], lora_layers=[1], eval_batch_size=16),
        dp=dict(expected_batch_size=4, contribution_bound=1, max_steps=2, learning_rate=1e-2, max_grad_norm=0.5,
                per_device_train_batch_size=8, max_loss=10.0, noise_seed=0),
        adaptive=dict(study_settings.CAUSAL_LM_SETTINGS["adaptive"]),
        non_private=dict(per_device_train_batch_size=4, learning_rate=1e-2, max_steps=2),
    )
    return settings, folder


def test_causal_lm_study_writes_results_cards_plot_and_resumes(tiny_lm_study, tmp_path):
    settings, _ = tiny_lm_study
    runs = ["baseline", "non-private", "uls-eps8", "uls-eps8-adaptive"]
    logged = []
    summary = study.run_study(str(tmp_path), task="causal_lm", settings=settings, runs=runs, progress=False,
                              log=logged.append)
    results = {run: load_result(tmp_path / f"{run}.json") for run in runs}
    for run, result in results.items():
        assert result is not None and set(RESULT_KEYS) <= set(result), run
        assert result["task"] == "causal-lm" and result["metric_name"] == "perplexity"
        assert result["eval_nll"] == pytest.approx(math.log(result["eval_result"]))
        assert result["base_model"] == settings["config"]["model_name_or_path"]
    baseline, plain, uls = results["baseline"], results["non-private"], results["uls-eps8"]
    assert baseline["mechanism"] == "public-only" and baseline["epsilon"] == 0.0 and baseline["model_dir"] is None
    assert uls["baseline_result"] == plain["baseline_result"] == baseline["eval_result"]  # one baseline, not three
    assert uls["non_private_result"] == plain["eval_result"] and "non_private_result" not in plain
    assert uls["mechanism"] == "uls" and 0 < uls["epsilon"] <= 8.0
    assert (uls["config"]["expected_batch_size"], uls["config"]["contribution_bound"]) == (4, 1)
    card = (tmp_path / uls["model_dir"] / "README.md").read_text()
    assert "Public-only baseline" in card and "Non-private fine-tuning" in card
    assert (tmp_path / plain["model_dir"] / "README.md").is_file()
    if "uls-eps8-adaptive" in results:
        adaptive = results["uls-eps8-adaptive"]
        assert adaptive["config"]["adaptive_clipping"] is True and study_plot.is_adaptive(adaptive)
        assert not study_plot.is_adaptive(uls)
    table = {row["run"]: row for row in summary["table"]}
    assert list(table) == runs and summary["task"] == "causal-lm" and summary["metric_name"] == "perplexity"
    assert table["uls-eps8"]["eval_nll"] == pytest.approx(uls["eval_nll"])
    assert table["non-private"]["gap_closed"] == pytest.approx(1.0) and table["baseline"]["gap_closed"] == 0.0
    assert (tmp_path / "privacy_utility.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "summary.json").read_text())["table"] == json.loads(json.dumps(summary["table"]))

    # resumed: every finished run is reused, nothing trains again
    logged.clear()
    again = study.run_study(str(tmp_path), task="causal_lm", settings=settings, runs=runs, progress=False,
                            log=logged.append)
    assert sum("skipped" in line for line in logged) == len(runs) and len(logged) == len(runs)
    assert [row["eval_result"] for row in again["table"]] == [row["eval_result"] for row in summary["table"]]
    # a run outside the plan is refused with the plan's names
    with pytest.raises(ValueError, match="els-eps8"):
        study.run_study(str(tmp_path), task="causal_lm", settings=settings, runs=["els-eps8"], progress=False)


def test_runs_without_the_baseline_evaluate_it_once_first(tiny_lm_study, tmp_path):
    """`--runs uls-eps8` in an empty folder: the baseline every card states is evaluated first, as
    `baseline.json`, not once per run beside it."""
    settings, _ = tiny_lm_study
    logged = []
    summary = study.run_study(str(tmp_path), task="causal_lm", settings=settings, runs=["uls-eps8"],
                              progress=False, log=logged.append)
    assert [row["run"] for row in summary["table"]] == ["baseline", "uls-eps8"]
    assert logged[0].startswith("[1/2] baseline") and logged[2].startswith("[2/2] uls-eps8")
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["baseline.json", "summary.json", "uls-eps8.json"]
    baseline, uls = load_result(tmp_path / "baseline.json"), load_result(tmp_path / "uls-eps8.json")
    assert uls["baseline_result"] == baseline["eval_result"]


@pytest.mark.slow
def test_causal_lm_grid_on_the_tiny_model(tiny_lm_study, tmp_path):
    """Every run of the grid, fixed and adaptive clipping, trains and is summarised."""
    settings, _ = tiny_lm_study
    runs = [entry.run for entry in study_runs.runs_of_study(grid=True, task="causal_lm")]
    summary = study.run_study(str(tmp_path), task="causal_lm", settings=settings, grid=True, runs=runs,
                              progress=False, log=lambda line: None)
    assert [row["run"] for row in summary["table"]] == runs
    for row in summary["table"][2:]:
        assert 0 < row["epsilon"] <= row["target_epsilon"]
        assert row["adaptive_clipping"] == row["run"].endswith("-adaptive")


# --------------------------------------------------------------------------------------------------------------------
# The chat SFT study (the default): planned runs, seeds, and a tiny end-to-end run on a tiny chat Llama
# --------------------------------------------------------------------------------------------------------------------


def test_plan_runs_sft_demo_grid_and_seeds():
    demo = study_runs.runs_of_study(grid=False)  # the default task
    curve = ["uls-eps8-adaptive", "uls-eps3-adaptive", "uls-eps1-adaptive"]
    assert [r.run for r in demo] == ["baseline", "non-private", *curve]
    assert [(r.target_epsilon, r.adaptive) for r in demo[2:]] == [(8.0, True), (3.0, True), (1.0, True)]
    grid = study_runs.runs_of_study(grid=True, task="sft")
    assert {(r.mechanism, r.target_epsilon, r.adaptive) for r in grid} == {
        ("public-only", None, False), ("non-private", None, False), ("uls", 8.0, False),
        *{(m, e, True) for m in ("uls", "els") for e in (1.0, 3.0, 8.0)},
    }
    seeded = study_runs.runs_of_study(grid=False, task="sft", seeds=3)
    five = ["baseline", "non-private", *curve]
    assert [r.run for r in seeded] == five + [f"{run}-seed{seed}" for seed in (1, 2) for run in five]
    assert [r.seed for r in seeded] == [0] * 5 + [1] * 5 + [2] * 5
    assert seeded[7] == study_runs.StudyRun("uls-eps8-adaptive-seed1", "uls", 8.0, True, seed=1)
    assert study_runs.replicate_of("uls-eps8-adaptive-seed12") == ("uls-eps8-adaptive", 12)
    assert study_runs.replicate_of("non-private") == ("non-private", 0)
    with pytest.raises(ValueError, match="seeds=0"):
        study_runs.runs_of_study(grid=False, seeds=0)


def test_a_seed_sets_the_run_configs_seed_and_so_its_sample_and_training():
    (entry,) = [e for e in study_runs.runs_of_study(grid=False, task="sft", seeds=2)
                if e.run == "uls-eps8-adaptive-seed1"]
    config, args = study_runs.configure_run(entry, study_settings.SFT_SETTINGS, "/tmp/unused", examples_per_step=16,
                                            task="sft")
    assert (config.seed, args.seed, config.run) == (1, 1, "uls-eps8-adaptive-seed1")
    assert (args.mechanism, args.max_length, args.gradient_checkpointing) == ("uls", 64, False)
    assert config.system_prompt == study_settings.SFT_SYSTEM_PROMPT


def test_headline_table_gives_mean_and_standard_error_over_seeds():
    rows = [{"run": "uls-eps8-adaptive", "mechanism": "uls", "epsilon": 7.99, "eval_result": 10.0, "eval_nll": 2.0,
             "gap_closed": 0.6},
            {"run": "uls-eps8-adaptive-seed1", "mechanism": "uls", "epsilon": 7.99, "eval_result": 12.0,
             "eval_nll": 2.2, "gap_closed": 0.7},
            {"run": "uls-eps8-adaptive-seed2", "mechanism": "uls", "epsilon": 7.99, "eval_result": 14.0,
             "eval_nll": 2.4, "gap_closed": 0.8},
            {"run": "uls-eps3", "mechanism": "uls", "epsilon": 3.0, "eval_result": 1.0, "gap_closed": 0.1}]
    (row,) = study.headline_table(rows)  # a run with one seed has no spread to report
    assert (row["run"], row["n"]) == ("uls-eps8-adaptive", 3)
    assert row["gap_closed"]["mean"] == pytest.approx(0.7)
    assert row["gap_closed"]["standard_error"] == pytest.approx(0.1 / math.sqrt(3))  # std 0.1, n = 3
    assert row["eval_nll"]["values"] == [2.0, 2.2, 2.4]


@pytest.fixture(scope="module")
def tiny_chat_study(tmp_path_factory):
    """Settings of a chat SFT study on a tiny chat Llama (saved with its tokenizer and chat template) and JSONL
    train/test conversations whose users differ."""
    from tests.workflows.test_chat_sft import chat_tokenizer, conversations, tiny_chat_model

    folder = tmp_path_factory.mktemp("tiny-chat-study")
    tiny_chat_model().save_pretrained(folder / "model")
    chat_tokenizer().save_pretrained(folder / "model")
    conversations([f"u{i}" for i in range(24)]).to_json(folder / "train.jsonl")
    conversations([f"t{i}" for i in range(6)], seed=1).to_json(folder / "test.jsonl")
    settings = dict(
        config=dict(model_name_or_path=str(folder / "model"), dataset=str(folder / "train.jsonl"),
                    eval_dataset=str(folder / "test.jsonl"), max_length=24, use_lora=True, lora_r=2, lora_alpha=4,
                    lora_target_modules=["q_proj", "v_proj"], eval_batch_size=16, max_eval_examples=8,
                    system_prompt="w1 w2"),
        dp=dict(expected_batch_size=4, contribution_bound=1, max_steps=2, learning_rate=1e-2, max_grad_norm=0.5,
                per_device_train_batch_size=8, max_loss=10.0, gradient_checkpointing=False),
        adaptive=dict(study_settings.SFT_SETTINGS["adaptive"]),
        non_private=dict(per_device_train_batch_size=4, learning_rate=1e-2, max_steps=2, gradient_checkpointing=False),
    )
    return settings


def test_sft_study_with_seeds_writes_results_cards_and_headline(tiny_chat_study, tmp_path):
    logged = []
    summary = study.run_study(str(tmp_path), settings=tiny_chat_study, seeds=2, progress=False, log=logged.append)
    runs = [entry.run for entry in study_runs.runs_of_study(grid=False, task="sft", seeds=2)]
    results = {run: load_result(tmp_path / f"{run}.json") for run in runs}
    for run, result in results.items():
        assert result is not None and set(RESULT_KEYS) <= set(result), run
        assert result["task"] == "chat-sft" and result["metric_name"] == "completion perplexity"
        assert result["config"]["seed"] == study_runs.replicate_of(run)[1]
    for suffix in ("", "-seed1"):  # each seed's DP run states its own seed's baseline and non-private figures
        baseline, plain, uls = (results[name + suffix] for name in ("baseline", "non-private", "uls-eps8-adaptive"))
        assert baseline["mechanism"] == "public-only" and baseline["epsilon"] == 0.0
        assert uls["baseline_result"] == plain["baseline_result"] == baseline["eval_result"]
        assert uls["non_private_result"] == plain["eval_result"]
        assert uls["mechanism"] == "uls" and 0 < uls["epsilon"] <= 8.0 and uls["privacy"]["adaptive_clipping"]
        card = (tmp_path / uls["model_dir"] / "README.md").read_text()
        assert "Public-only baseline" in card and "Non-private fine-tuning" in card
    assert results["baseline"]["eval_result"] != results["baseline-seed1"]["eval_result"]  # another test sample
    assert summary["task"] == "chat-sft" and summary["seeds"] == 2
    headline = {row["run"]: row for row in summary["headline"]}
    assert set(headline) == {"baseline", "non-private", "uls-eps8-adaptive", "uls-eps3-adaptive", "uls-eps1-adaptive"}
    assert headline["non-private"]["gap_closed"]["values"] == [1.0, 1.0]
    gaps = [row["gap_closed"] for row in summary["table"] if row["run"].startswith("uls-eps8-adaptive")]
    assert headline["uls-eps8-adaptive"]["gap_closed"]["values"] == pytest.approx(gaps)
    assert (tmp_path / "privacy_utility.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "[1/10] baseline" in logged[0]


@pytest.mark.slow
def test_quick_sft_demo_on_smollm2(tmp_path):
    """`python -m hf_dp.workflows.study --quick` (the default task): the real SmolLM2-135M-Instruct fine-tuned with
    DPSFTTrainer and TRL's SFTTrainer on a few Shakespeare conversations, through the whole pipeline."""
    import os

    command = [sys.executable, "-m", "hf_dp.workflows.study", "--quick", "--results_dir", str(tmp_path),
               "--no_progress", "--num_threads", "1",
               "--runs", "non-private", "uls-eps8-adaptive"]  # ε = 3 and 1: the same path (the tiny study has them)
    env = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(command, capture_output=True, text=True, timeout=1200, cwd=ROOT,
                               env={**os.environ, **env})
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-5000:]
    for run in ("baseline", "non-private", "uls-eps8-adaptive"):
        result = load_result(tmp_path / f"{run}.json")
        assert result is not None and result["task"] == "chat-sft", run
        assert "smollm2" in result["base_model"] and math.isfinite(result["eval_nll"])
    uls = load_result(tmp_path / "uls-eps8-adaptive.json")
    assert uls["privacy"]["adaptive_clipping"] is True and 0 < uls["epsilon"] <= 8.0
    assert (tmp_path / uls["model_dir"] / "README.md").is_file()
    assert "uls-eps8-adaptive" in completed.stdout and "gap closed" in completed.stdout


def test_the_app_line_names_the_install_only_where_gradio_is_missing(monkeypatch):
    import importlib.util

    from hf_dp.workflows.study import app_command

    assert app_command("my results").startswith("Explore them in the app: hf-dp app --results_dir 'my results'")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert "pip install 'hf_dp[app]' && hf-dp app --results_dir results " in app_command("results")
