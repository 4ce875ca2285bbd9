"""`hf-dp audit`: its flags, and --quick runs end to end: the chat task on a tiny chat Llama (fast) and on SmolLM2
with Shakespeare conversations (slow), the classification task on MiniLM (slow)."""
from __future__ import annotations

import json

import pytest
from huggingface_hub.utils import filter_repo_objects

from hf_dp.workflows import audit_demo



def test_parser_flags_use_the_training_argument_names():
    args = audit_demo.build_parser().parse_args([
        "--target_epsilon", "1", "--canaries", "512", "--rows_per_canary", "2", "--confidence", "0.9",
        "--results_dir", "out", "--score", "white-box", "--max_steps", "50", "--canary_seed", "3", "--quick",
        "--no_progress", "--num_threads", "1"])
    assert (args.target_epsilon, args.canaries, args.rows_per_canary, args.confidence, args.results_dir) == \
        (1.0, 512, 2, 0.9, "out")
    assert (args.score, args.max_steps, args.canary_seed, args.quick, args.no_progress) == \
        ("white-box", 50, 3, True, True)
    defaults = audit_demo.build_parser().parse_args([])
    assert (defaults.target_epsilon, defaults.canaries, defaults.confidence, defaults.score) == \
        (2.0, None, 0.95, "auto")
    assert (defaults.sabotage, defaults.max_train_users, defaults.target_delta) == (None, None, None)
    more = audit_demo.build_parser().parse_args(["--sabotage", "no-noise", "--max_train_users", "16",
                                                 "--target_delta", "1e-6"])
    assert (more.sabotage, more.max_train_users, more.target_delta) == ("no-noise", 16, 1e-6)
    with pytest.raises(SystemExit):  # only the named sabotage exists
        audit_demo.build_parser().parse_args(["--sabotage", "no-clipping"])
    # As `hf-dp audit` registers it: the same dataclass on a subparser, `run` as the handler.
    from hf_dp import cli

    parsed = cli.build_parser().parse_args(["audit", "--canaries", "8", "--max-steps", "None"])
    assert (parsed.canaries, parsed.max_steps, parsed.func) == (8, None, audit_demo.run)


def test_format_result_warns_only_above_the_proven_epsilon():
    audit = {"canaries": 256, "rows_per_canary": 1, "score": "black-box", "delta": 8e-5, "confidence": 0.95,
             "epsilon_lower_bound": 0.0, "fdp_epsilon_lower_bound": 0.0, "epsilon_ceiling": 3.7, "correct": 7,
             "guesses": [13, 0], "exceeds_upper_bound": False}
    result = {"audit": audit, "epsilon": 7.99, "eval_result": 0.45, "baseline_result": 0.44,
              "base_model": "m", "dataset": "d"}
    table = audit_demo.format_result(result)
    assert "7 of 13" in table and "7.99" in table and "WARNING" not in table
    result["audit"] = dict(audit, epsilon_lower_bound=9.0, exceeds_upper_bound=True,
                           verdict="the audit FAILED: lower bound 9.00 > proven ε 7.99: the implementation is broken")
    assert "WARNING: the audit FAILED: lower bound 9.00 > proven ε 7.99" in audit_demo.format_result(result)


# ---- the deliberately broken run, and the failure it must raise -----------------------------------------------


def _aggregate(step_grad_of_zero=True):
    """DPStep.aggregate on one parameter whose clipped sum is zero: what is left in .grad is the noise alone."""
    from types import SimpleNamespace

    import torch

    from hf_dp.step import DPStep

    param = torch.nn.Parameter(torch.zeros(1000))
    fake = SimpleNamespace(settings=SimpleNamespace(distributed=False, secure_noise=False),
                           _noise_multiplier=1.0, _expected_batch_size=4, seed=7)  # read from the plan once
    DPStep.aggregate(fake, [param], ["w"], None, max_grad_norm=1.0, step=0)
    return param.grad


def test_sabotage_no_noise_removes_the_gradient_noise_only_inside_its_run():
    import torch

    from hf_dp import step

    assert _aggregate().std() > 0.2  # σ·C/(q·N) = 1/4 per element
    with audit_demo.sabotage("no-noise"):
        assert torch.count_nonzero(_aggregate()) == 0  # the step ran and added nothing
    assert _aggregate().std() > 0.2 and step.add_noise.__module__ == "hf_dp.noise"  # restored after the run
    with audit_demo.sabotage(None):
        assert _aggregate().std() > 0.2
    with pytest.raises(ValueError, match="sabotage='no-clipping'"):
        with audit_demo.sabotage("no-clipping"):
            pass
    from hf_dp import DPTrainingArguments

    assert not any("sabotage" in f for f in DPTrainingArguments.__dataclass_fields__)  # no public switch


def test_a_failed_audit_is_loud_and_exits_with_code_3(monkeypatch, capsys):
    """`hf-dp audit` returns AUDIT_FAILED_EXIT_CODE (3) when the lower bound exceeds the proven ε, 0 otherwise."""
    import numpy as np

    from hf_dp.audit import audit_report

    rng = np.random.default_rng(0)
    included = rng.random(1000) < 0.5
    perfect = audit_report(included.astype(float), included, delta=1e-5, epsilon_upper_bound=1.0)

    def fake_run_audit(report):
        def run_audit(**kwargs):
            return {"audit": report.to_dict(), "audit_failed": report.failed, "verdict": report.verdict,
                    "epsilon": report.epsilon_upper_bound, "eval_result": 20.0, "baseline_result": 21.0,
                    "metric_name": "completion perplexity", "base_model": "m", "dataset": "d", "seconds": 1.0,
                    "model_dir": "models/audit", "visits_per_canary": 8.3, "sabotage": kwargs["sabotage_run"]}
        return run_audit

    monkeypatch.setattr(audit_demo, "run_audit", fake_run_audit(perfect))
    assert audit_demo.main(["--sabotage", "no-noise", "--no_progress"]) == audit_demo.AUDIT_FAILED_EXIT_CODE == 3
    captured = capsys.readouterr()
    assert "WARNING: the audit FAILED: lower bound" in captured.out and "> proven ε 1.00" in captured.out
    assert "the audit FAILED" in captured.err and "exit code 3" in captured.err
    assert "--sabotage no-noise" in captured.out and "8.3" in captured.out
    passed = audit_report(included.astype(float), included, delta=1e-5, epsilon_upper_bound=8.0)
    monkeypatch.setattr(audit_demo, "run_audit", fake_run_audit(passed))
    assert audit_demo.main(["--no_progress"]) == 0
    assert "FAILED" not in capsys.readouterr().out


@pytest.mark.slow
def test_quick_audit_writes_audit_json_card_section_and_a_private_record(tmp_path, capsys):
    from hf_dp.audit import Canaries, is_canary_user
    from hf_dp.audit.record import AUDIT_FILE, check_audit_record
    from hf_dp.hub import IGNORE_PATTERNS

    assert audit_demo.main(["--task", "classification", "--quick", "--results_dir", str(tmp_path), "--no_progress",
                            "--canary_seed", "1", "--noise_seed", "2"]) == 0
    result = json.loads((tmp_path / "audit.json").read_text())
    audit = result["audit"]
    assert audit["canaries"] == 16 and audit["rows_per_canary"] == 1 and audit["confidence"] == 0.95
    assert audit["score"] == "black-box" and 0 <= audit["epsilon_lower_bound"] <= audit["epsilon_ceiling"]
    assert 0 < result["epsilon"] <= 8.0 and audit["epsilon_upper_bound"] == result["epsilon"]
    assert audit["delta"] == result["delta"] == result["privacy"]["delta"]
    assert 0 <= result["eval_result"] <= 1 and 0 <= result["baseline_result"] <= 1
    assert result["num_train_users"] == 48  # real roles only: canaries are never counted

    model_dir = tmp_path / result["model_dir"]
    record = Canaries.load(tmp_path / result["audit_record"])
    assert len(record) == 16 and all(is_canary_user(u) for u in record.user_ids)
    card = (model_dir / "README.md").read_text()
    assert "## Empirical audit" in card and "this model's own training run" in card
    # --quick trains a fixed-size sample of 48 roles: card and result say what that does to the guarantee
    assert "fixed-size sample of 48 of the available users" in card and "replace-one" in result["not_covered"][0]
    files = [str(p.relative_to(model_dir)) for p in model_dir.rglob("*") if p.is_file()]
    uploaded = list(filter_repo_objects(files, ignore_patterns=IGNORE_PATTERNS))
    assert "README.md" in uploaded and "config.json" in uploaded and AUDIT_FILE in uploaded  # the section's report
    assert not any(name.startswith("_audit") or "canar" in name for name in uploaded)
    saved, audited_model = check_audit_record(json.loads((model_dir / AUDIT_FILE).read_text()))
    assert audited_model and saved.to_dict() == audit and saved.card_section(audited_model=True).strip() in card
    out = capsys.readouterr().out
    assert "ε audited (lower bound, Steinke et al.)" in out and "audit.json" in out


# ---- bad inputs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_steps=-5), "--max_steps -5: use a whole number >= 1"),  # used to train 59 steps
    (dict(max_steps=0), "--max_steps 0: use a whole number >= 1"),  # used to hang
    (dict(max_eval_examples=0), "--max_eval_examples 0: use a whole number >= 1"),  # used to be an IndexError
    (dict(confidence=1.5), "--confidence 1.5: use a number strictly between 0 and 1"),
    (dict(canaries=1), "--canaries 1: use a whole number >= 2"),
    (dict(rows_per_canary=9), "--rows_per_canary 9: the audited run keeps at most G = 8 rows per user"),
    (dict(target_epsilon=float("nan")), "--target_epsilon nan: use a finite number > 0"),
    (dict(canaries=100_000_000), "--canaries 100,000,000: the audited run samples 32 users a step for 100 steps"),
])
def test_run_audit_refuses_bad_numbers_before_loading_anything(tmp_path, monkeypatch, kwargs, match):
    import hf_dp.workflows.tasks.classification as classification

    def never(*args, **kwargs):
        raise AssertionError("data was loaded before the arguments were checked")

    monkeypatch.setattr(classification, "load_classification_data", never)
    with pytest.raises(ValueError) as error:
        audit_demo.run_audit(task="classification", results_dir=str(tmp_path / "results"), progress=False, **kwargs)
    assert str(error.value).startswith(match)
    assert list(tmp_path.iterdir()) == []  # nothing trained, nothing written


@pytest.mark.parametrize("kwargs, match", [
    (dict(rows_per_canary=2), "--rows_per_canary 2: the audited run keeps at most G = 1 row per user"),
    (dict(task="causal_lm"), "--task 'causal_lm': use one of sft, classification"),
])
def test_sft_audit_refuses_bad_input_before_loading_anything(tmp_path, monkeypatch, kwargs, match):
    import hf_dp.workflows.tasks.chat_sft as chat_sft

    def never(*args, **kwargs):
        raise AssertionError("data was loaded before the arguments were checked")

    monkeypatch.setattr(chat_sft, "load_chat_data", never)
    with pytest.raises(ValueError) as error:
        audit_demo.run_audit(results_dir=str(tmp_path / "results"), progress=False, **kwargs)
    assert str(error.value).startswith(match)
    assert list(tmp_path.iterdir()) == []


# ---- the chat task (the default) -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_chat_settings(tmp_path_factory):
    """The chat study's settings on a tiny chat Llama (saved with its tokenizer and chat template) and JSONL
    train/test conversations whose users differ."""
    from tests.workflows.test_chat_sft import chat_tokenizer, conversations, tiny_chat_model

    folder = tmp_path_factory.mktemp("tiny-chat-audit")
    tiny_chat_model().save_pretrained(folder / "model")
    chat_tokenizer().save_pretrained(folder / "model")
    conversations([f"u{i}" for i in range(24)]).to_json(folder / "train.jsonl")
    conversations([f"t{i}" for i in range(6)], seed=1).to_json(folder / "test.jsonl")
    return dict(
        config=dict(model_name_or_path=str(folder / "model"), dataset=str(folder / "train.jsonl"),
                    eval_dataset=str(folder / "test.jsonl"), max_length=32, use_lora=True, lora_r=2, lora_alpha=4,
                    lora_target_modules=["q_proj", "v_proj"], eval_batch_size=16, system_prompt="w1 w2"),
        dp=dict(expected_batch_size=4, contribution_bound=1, max_steps=2, learning_rate=1e-2, max_grad_norm=0.5,
                per_device_train_batch_size=8, max_loss=10.0, gradient_checkpointing=False),
        adaptive=dict(adaptive_clipping=True, target_unclipped_quantile=0.5, clipping_learning_rate=0.2,
                      clipping_count_noise=None),
    )


def _check_sft_audit(tmp_path, result, *, canaries: int, train_users: int):
    from hf_dp.audit import Canaries, is_canary_user
    from hf_dp.hub import IGNORE_PATTERNS

    audit = result["audit"]
    assert result["audited_task"] == "sft" and result["metric_name"] == "completion perplexity"
    assert audit["canaries"] == canaries and audit["rows_per_canary"] == 1 and audit["score"] == "trained-loss"
    assert 0 <= audit["epsilon_lower_bound"] <= audit["epsilon_ceiling"]
    assert 0 < result["epsilon"] <= 8.0 and audit["epsilon_upper_bound"] == result["epsilon"]
    assert audit["delta"] == result["delta"] == result["privacy"]["delta"]
    assert result["privacy"]["adaptive_clipping"] and result["privacy"]["contribution_bound"] == 1
    assert result["eval_result"] > 1 and result["baseline_result"] > 1  # perplexities
    assert result["num_train_users"] == train_users  # real roles only: canaries are never counted
    record = Canaries.load(tmp_path / result["audit_record"])
    assert len(record) == canaries and all(is_canary_user(u) for u in record.user_ids)
    assert record.prompt_column == "prompt" and record.text_column == "completion"
    assert list(audit["guesses"]) and sum(audit["guesses"]) <= canaries
    model_dir = tmp_path / result["model_dir"]
    card = (model_dir / "README.md").read_text()
    assert "## Empirical audit" in card and "this model's own training run" in card
    files = [str(p.relative_to(model_dir)) for p in model_dir.rglob("*") if p.is_file()]
    uploaded = list(filter_repo_objects(files, ignore_patterns=IGNORE_PATTERNS))
    # The report the card's section is rendered from goes up with it; the canaries' coins (`_audit/`) never do.
    assert "README.md" in uploaded and "dp_audit.json" in uploaded
    assert not any(name.startswith("_") or "canar" in name for name in uploaded)


def test_quick_sft_audit_on_a_tiny_chat_model(tmp_path, tiny_chat_settings, capsys):
    logged = []
    result = audit_demo.run_audit(quick=True, results_dir=str(tmp_path), progress=False, canary_seed=1,
                                  noise_seed=2, settings=tiny_chat_settings, log=logged.append)
    _check_sft_audit(tmp_path, result, canaries=16, train_users=24)
    assert json.loads((tmp_path / "audit.json").read_text())["audit"] == result["audit"]
    assert result["settings"]["training"]["max_steps"] == 2  # --quick keeps the settings' steps
    assert result["audit_failed"] == result["audit"]["audit_failed"] and "verdict" in result
    assert result["visits_per_canary"] == pytest.approx(result["privacy"]["sample_rate"] * 2)
    # The toy word-level vocabulary has no rare words to spare: replies fall back to shared words, and say so.
    assert result["settings"]["canary_replies"] == "shared-words" and any("fall back" in line for line in logged)
    assert any("[3/4]" in line and "16 canary users" in line for line in logged)
    table = audit_demo.format_result(result)
    assert "test completion perplexity (public-only baseline)" in table and "ceiling of m = 16" in table


@pytest.mark.slow
def test_quick_sft_audit_on_smollm2_writes_audit_json_and_card(tmp_path, capsys):
    assert audit_demo.main(["--quick", "--results_dir", str(tmp_path), "--no_progress", "--canary_seed", "1",
                            "--noise_seed", "2"]) == 0
    result = json.loads((tmp_path / "audit.json").read_text())
    _check_sft_audit(tmp_path, result, canaries=16, train_users=48)
    # SmolLM2's vocabulary: each canary's reply is rare words that no other canary's reply holds.
    from hf_dp.audit import Canaries

    assert result["settings"]["canary_replies"] == "rare-words"
    record = Canaries.load(tmp_path / result["audit_record"])
    words = [w for i in range(16) for row in record.rows_of(i) for w in row["completion"][0]["content"].split()]
    assert len(words) == 16 * audit_demo.REPLY_WORDS and len(set(words)) == len(words)
    out = capsys.readouterr().out
    assert "ε audited (lower bound, Steinke et al.)" in out and "completion perplexity" in out
