"""hf_dp.hub: card checks, offline / unreachable Hub fail before any upload, the upload calls themselves.

HfApi is replaced by a recorder: no test reaches the network (the "unreachable" case talks to a closed local port).
"""
from __future__ import annotations

import json
import re
import socket

import huggingface_hub
import pytest
from huggingface_hub import constants

from app_fixtures import make_tokenizer, privacy_ledger, tiny_classifier, verified_report
from hf_dp import hub as publish_module
from hf_dp.card import LEDGER_FILE, write_privacy_card
from hf_dp.hub import (
    HubUnreachableError,
    PrivacyCardError,
    check_privacy_card,
    ensure_hub_reachable,
    publish,
)


class RecordingHfApi:
    """Stands in for huggingface_hub.HfApi: records calls, uploads nothing."""

    calls: list = []
    endpoint_for_tests = "http://127.0.0.1:9"

    def __init__(self, token=None, endpoint=None, **kwargs):
        self.token = token
        self.endpoint = endpoint or self.endpoint_for_tests

    def create_repo(self, repo_id, **kwargs):
        RecordingHfApi.calls.append(("create_repo", repo_id, kwargs))
        return huggingface_hub.RepoUrl(f"https://hub.test/{repo_id}", endpoint="https://hub.test")

    def upload_folder(self, **kwargs):
        RecordingHfApi.calls.append(("upload_folder", kwargs["repo_id"], kwargs))
        return "commit"


@pytest.fixture
def api(monkeypatch):
    RecordingHfApi.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingHfApi)
    return RecordingHfApi


@pytest.fixture
def model_dir(tmp_path):
    folder = tmp_path / "models" / "uls-eps8"
    tokenizer = make_tokenizer()
    tiny_classifier(0, len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    report, ledger = verified_report("uls")
    write_privacy_card(report, folder, ledger=ledger, base_model="test/tiny", eval_result=0.7, baseline_result=0.4)
    (folder / "checkpoint-5").mkdir()
    (folder / "checkpoint-5" / "dp_resume.json").write_text("{}")
    return folder


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def online(monkeypatch):
    """Pretend offline mode is off (the endpoint is still a local address, never the real Hub)."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(RecordingHfApi, "endpoint_for_tests", f"http://127.0.0.1:{closed_port()}")


def test_offline_fails_with_one_clear_line_before_any_upload(model_dir, api, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubUnreachableError) as error:
        publish(model_dir, "alice/model", token="hf_test")
    message = str(error.value)
    assert "\n" not in message and "HF_HUB_OFFLINE" in message and "nothing was uploaded" in message
    assert api.calls == []


def test_unreachable_endpoint_fails_before_any_upload(model_dir, api, online):
    with pytest.raises(HubUnreachableError, match="unreachable") as error:
        publish(model_dir, "alice/model", token="hf_test")
    assert "\n" not in str(error.value)
    assert api.calls == []


def test_ensure_hub_reachable_offline_env_is_read_at_call_time(monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubUnreachableError, match="offline mode"):
        ensure_hub_reachable("http://127.0.0.1:9")


def test_publish_uploads_model_tokenizer_and_card(model_dir, api, monkeypatch):
    monkeypatch.setattr(publish_module, "ensure_hub_reachable", lambda endpoint=None, **kw: None)
    url = publish(model_dir, "alice/minilm-uls", token="hf_test")
    assert url == "https://hub.test/alice/minilm-uls"
    (create, repo, create_kwargs), (upload, repo2, upload_kwargs) = api.calls
    assert (create, repo, upload, repo2) == ("create_repo", "alice/minilm-uls", "upload_folder", "alice/minilm-uls")
    assert create_kwargs["private"] is True and create_kwargs["exist_ok"] is True
    assert upload_kwargs["folder_path"] == model_dir
    assert "checkpoint-*" in upload_kwargs["ignore_patterns"]
    assert "(3.17, 1e-05)-DP" in upload_kwargs["commit_message"] and "user" in upload_kwargs["commit_message"]
    uploaded = {p.name for p in model_dir.iterdir()}
    assert {"README.md", "dp_ledger.json", "config.json", "model.safetensors", "tokenizer.json"} <= uploaded
    assert "dp_ledger.json" not in upload_kwargs["ignore_patterns"]  # published: anyone can recompute ε


def test_publish_accepts_a_result_json(model_dir, api, monkeypatch):
    monkeypatch.setattr(publish_module, "ensure_hub_reachable", lambda endpoint=None, **kw: None)
    result = model_dir.parent.parent / "uls-eps8.json"
    result.write_text('{"run": "uls-eps8", "model_dir": "models/uls-eps8"}')
    publish(result, "alice/m", token="t", private=False)
    assert api.calls[0][2]["private"] is False
    assert api.calls[1][2]["folder_path"].resolve() == model_dir.resolve()


def test_card_checks(model_dir, tmp_path):
    privacy = check_privacy_card(model_dir)
    assert privacy["epsilon"] == pytest.approx(3.1625, abs=1e-4) and privacy["privacy_unit"] == "user"

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(PrivacyCardError, match="write_privacy_card"):
        check_privacy_card(empty)

    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "README.md").write_text("---\nlicense: mit\n---\n# A model\n")
    with pytest.raises(PrivacyCardError, match="no 'privacy:' block"):
        check_privacy_card(plain)

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "README.md").write_text("---\nprivacy: [unclosed\n---\n# A model\n")
    with pytest.raises(PrivacyCardError, match="does not parse"):
        check_privacy_card(broken)

    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "README.md").write_text("---\nprivacy:\n  epsilon: 3.0\n---\n# A model\n")
    with pytest.raises(PrivacyCardError, match="lacks"):
        check_privacy_card(partial)

    nonprivate = tmp_path / "nonprivate"
    write_privacy_card({"non_private": True}, nonprivate, base_model="test/tiny", eval_result=0.8)
    with pytest.raises(PrivacyCardError, match="WITHOUT differential privacy"):
        check_privacy_card(nonprivate)
    assert check_privacy_card(nonprivate, allow_non_private=True)["non_private"] is True
    # A plain Trainer's folder (its own card, or none): allow_non_private says what it publishes and how to get it.
    trainer_card = tmp_path / "trainer-card"
    trainer_card.mkdir()
    (trainer_card / "README.md").write_text("---\nlicense: apache-2.0\ntags:\n- generated_from_trainer\n---\n# out\n")
    for plain in (tmp_path / "no-card", trainer_card):
        plain.mkdir(exist_ok=True)
        with pytest.raises(PrivacyCardError, match=r"allow_non_private publishes a card that states the model has no "
                                                   r"DP guarantee.*write_privacy_card\(\{'non_private': True\}"):
            check_privacy_card(plain, allow_non_private=True)


def _edit_front_matter(model_dir, line: str, replacement: str) -> None:
    """Replace the first match of the pattern `line` (a plain line is escaped) with `replacement`."""
    readme = model_dir / "README.md"
    text = readme.read_text(encoding="utf-8")
    pattern = line if "[" in line else re.escape(line)
    edited, count = re.subn(pattern, lambda _: replacement, text, count=1)
    assert count == 1, line
    readme.write_text(edited, encoding="utf-8")


@pytest.mark.parametrize("line, replacement, field", [
    (r"  epsilon: [0-9.]+\n", "  epsilon: '7.9'\n", "privacy.epsilon (ε) is the str '7.9'"),
    (r"  epsilon: [0-9.]+\n", '  epsilon: "8"\n', "privacy.epsilon (ε) is the str '8'"),
    (r"  delta: [0-9.e-]+\n", "  delta: '1e-5'\n", "privacy.delta (δ) is the str '1e-5'"),
])
def test_a_string_epsilon_is_refused_by_the_check_in_one_line(model_dir, api, monkeypatch, capsys, line, replacement,
                                                              field):
    """ε (or δ) quoted in the card's YAML: refused by the card check, naming the field and the fix, before any
    format code or upload sees it."""
    _edit_front_matter(model_dir, line, replacement)
    with pytest.raises(PrivacyCardError, match="write it unquoted") as error:
        check_privacy_card(model_dir)
    assert field in str(error.value) and "\n" not in str(error.value)
    monkeypatch.setattr(publish_module, "ensure_hub_reachable", lambda *a, **k: None)
    code = publish_module.main([str(model_dir), "--repo_id", "alice/model", "--token", "t"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and field in err and "Traceback" not in err
    assert "format code" not in err
    assert api.calls == []


def test_mechanism_is_checked_against_the_ledger(model_dir):
    _edit_front_matter(model_dir, "  mechanism: uls\n", "  mechanism: els\n")
    with pytest.raises(PrivacyCardError, match="the card says mechanism = 'els' but its ledger"):
        check_privacy_card(model_dir)
    _edit_front_matter(model_dir, "  mechanism: els\n", "  mechanism: user-level sampling\n")
    with pytest.raises(PrivacyCardError, match="privacy.mechanism = 'user-level sampling' is not one of"):
        check_privacy_card(model_dir)


def test_example_level_card_publishes_without_sampling(tmp_path):
    """An example-level card has `sampling: null` (unused there): the check goes by the mechanism."""
    folder = tmp_path / "example"
    report, ledger = verified_report("example")
    assert report["sampling"] is None
    write_privacy_card(report, folder, ledger=ledger, base_model="test/tiny")
    privacy = check_privacy_card(folder)
    assert privacy["mechanism"] == "example" and privacy["sampling"] is None


def test_missing_card_is_refused_before_reachability(tmp_path, api, monkeypatch):
    called = []
    monkeypatch.setattr(publish_module, "ensure_hub_reachable", lambda *a, **k: called.append(1))
    folder = tmp_path / "model"
    tiny_classifier(0, 20).save_pretrained(folder)
    with pytest.raises(PrivacyCardError, match="does not exist"):
        publish(folder, "alice/m", token="t")
    assert called == [] and api.calls == []


def test_bad_repo_id_and_no_weights(model_dir, tmp_path, api):
    with pytest.raises(ValueError, match="--repo_id"):
        publish(model_dir, "not a repo id", token="t")
    cardonly = tmp_path / "cardonly"
    report, ledger = verified_report("uls")
    write_privacy_card(report, cardonly, ledger=ledger, base_model="test/tiny")
    with pytest.raises(FileNotFoundError, match="config.json"):
        publish(cardonly, "alice/m", token="t")
    tiny_classifier(0, 20).config.save_pretrained(cardonly)
    (cardonly / "training_args.bin").write_bytes(b"Trainer's arguments, not weights")
    with pytest.raises(FileNotFoundError, match="has no weights"):
        publish(cardonly, "alice/m", token="t")
    assert api.calls == []


def test_cli_prints_one_line_and_exits_1_offline(model_dir, api, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = publish_module.main([str(model_dir), "--repo-id", "alice/model"])  # dashes accepted
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err and "offline" in err
    assert api.calls == []


def test_dptrainer_push_to_hub_offline_fails_clearly(tmp_path, api, monkeypatch):
    from hf_dp import DPTrainer, DPTrainingArguments
    from trainer_fixtures import pad_collator, tiny_bert, user_dataset

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = DPTrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, expected_batch_size=8,
                               per_device_train_batch_size=4, noise_multiplier=1.0, noise_seed=1, report_to=[],
                               save_strategy="no", use_cpu=True, disable_tqdm=True, hub_model_id="alice/m")
    trainer = DPTrainer(model=tiny_bert(), args=args, train_dataset=user_dataset(), data_collator=pad_collator)
    with pytest.raises(HubUnreachableError, match="offline"):
        trainer.push_to_hub()
    assert api.calls == []


# ---- publish checks the card against the ledger beside it ---------------------------------------------------------


@pytest.fixture
def card_dir(tmp_path):
    report, ledger = verified_report("uls")
    folder = tmp_path / "model"
    write_privacy_card(report, folder, ledger=ledger, base_model="test/tiny")
    return folder


def _set_front_matter(folder, key, value):
    readme = folder / "README.md"
    text, count = re.subn(rf"(?m)^  {key}: .*$", f"  {key}: {value}", readme.read_text(encoding="utf-8"))
    assert count == 1
    readme.write_text(text, encoding="utf-8")


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("epsilon", "0.01", "claims ε = 0.01 but its ledger proves ε = 3.16"),
        ("epsilon", "9.5", "privacy section differs"),  # overstated too (a regenerated card: test_card_check.py)
        ("epsilon", "-5", "not a finite number"),
        ("epsilon", ".nan", "not a finite number"),
        ("epsilon", "true", "not a number"),
        ("delta", "0.9", "δ = 0.9 but its ledger"),
        ("delta", "1.0e-06", "δ = 1e-06 but its ledger"),
        ("delta", "1.5", "not in \\(0, 1\\)"),
        ("privacy_unit", "example", "privacy_unit = 'example'"),
        ("mechanism", "els", "mechanism = 'els'"),
        ("steps", "4", "steps = 4"),
    ],
)
def test_publish_refuses_a_hand_edited_front_matter(card_dir, key, value, message):
    assert check_privacy_card(card_dir)["epsilon"] == pytest.approx(3.1625, abs=1e-4)
    _set_front_matter(card_dir, key, value)
    with pytest.raises(PrivacyCardError, match=message) as error:
        check_privacy_card(card_dir)
    assert "\n" not in str(error.value)


def test_publish_refuses_a_hand_edited_text(card_dir):
    readme = card_dir / "README.md"
    original = readme.read_text(encoding="utf-8")
    assert "**(3.17, 1e-05)-differential privacy" in original
    readme.write_text(original.replace("**(3.17, 1e-05)", "**(0.01, 1e-05)"), encoding="utf-8")
    with pytest.raises(PrivacyCardError, match=r"it says 'Training satisfies \*\*\(0.01, 1e-05\)"):
        check_privacy_card(card_dir)
    readme.write_text(original.replace("| δ (`delta`) | 1e-05 |", "| δ (`delta`) | 1e-09 |"), encoding="utf-8")
    with pytest.raises(PrivacyCardError, match=r"privacy section differs .* '\| δ \(`delta`\) \| 1e-09 \|'"):
        check_privacy_card(card_dir)
    assert "a factor exp(3.17)" in original and "except with probability at most 1e-05" in original
    readme.write_text(original.replace("a factor exp(3.17)", "a factor exp(1.00)"), encoding="utf-8")
    with pytest.raises(PrivacyCardError, match=r"privacy section differs .*exp\(1.00\)"):  # the prose's e^ε
        check_privacy_card(card_dir)
    readme.write_text(original.replace("probability at most 1e-05", "probability at most 1e-09"), encoding="utf-8")
    with pytest.raises(PrivacyCardError, match=r"privacy section differs .*at most 1e-09"):
        check_privacy_card(card_dir)
    # Every word and number of the section is the report's, not only those a pattern would look for: σ, q, C too.
    sigma_row = re.search(r"^\| Noise multiplier σ \(`noise_multiplier`\) \| [^|]+ \|$", original, re.M).group(0)
    readme.write_text(original.replace(sigma_row, "| Noise multiplier σ (`noise_multiplier`) | 9.99 |"),
                      encoding="utf-8")
    with pytest.raises(PrivacyCardError, match=r"privacy section differs .*9\.99"):
        check_privacy_card(card_dir)
    # The block itself is checked against the ledger: a lowered estimate there is refused, whatever the text says.
    readme.write_text(re.sub(r"epsilon_estimate: [0-9.e+-]+", "epsilon_estimate: 0.001", original), encoding="utf-8")
    with pytest.raises(PrivacyCardError, match="privacy.epsilon_estimate = 0.001 is below its ledger"):
        check_privacy_card(card_dir)


def test_publish_refuses_a_card_without_its_ledger(card_dir):
    (card_dir / LEDGER_FILE).unlink()
    with pytest.raises(PrivacyCardError, match="dp_ledger.json does not exist"):
        check_privacy_card(card_dir)
    (card_dir / LEDGER_FILE).write_text('{"format": 1, "delta": 1e-05}')
    with pytest.raises(PrivacyCardError, match="not a ledger written by hf_dp"):
        check_privacy_card(card_dir)


def test_publish_refuses_a_ledger_that_spent_more_than_the_card_says(card_dir):
    report, _ = verified_report("uls")
    greedy = privacy_ledger(dict(report, noise_multiplier=0.5))  # same steps, far more ε than 3.16
    (card_dir / LEDGER_FILE).write_text(json.dumps(greedy))
    with pytest.raises(PrivacyCardError, match="understated"):
        check_privacy_card(card_dir)


def test_publish_refuses_a_ledger_that_does_not_say_what_its_noise_left_out_of_delta(card_dir):
    """A ledger written before the noise reached 14σ stated δ for ideal Gaussian noise: refused, not republished."""
    ledger = json.loads((card_dir / LEDGER_FILE).read_text())
    del ledger["noise"]
    (card_dir / LEDGER_FILE).write_text(json.dumps(ledger))
    with pytest.raises(PrivacyCardError, match="records no noise sampler"):
        check_privacy_card(card_dir)


def test_publish_checks_the_cards_delta_against_the_ledgers_sampler_term(card_dir):
    ledger = json.loads((card_dir / LEDGER_FILE).read_text())
    ledger["noise"]["draws_per_step"] = 10**44  # so many draws that the sampler's term is larger than δ itself
    (card_dir / LEDGER_FILE).write_text(json.dumps(ledger))
    with pytest.raises(PrivacyCardError, match="δ = 1e-05 but its ledger"):
        check_privacy_card(card_dir)


# ---- a trained run's card: Hub metadata and the Accounting paragraph ------------------------------------------------


@pytest.fixture(scope="module")
def trained_cards(tmp_path_factory):
    """A classifier run from a local model folder and a causal-LM run, each trained 2 steps (card and ledger)."""
    from trainer_fixtures import make_trainer, tiny_bert, tiny_llama, user_dataset

    root = tmp_path_factory.mktemp("trained")
    classifier = tiny_bert()
    classifier.config._name_or_path = str(root / "home" / "alice" / "models" / "base")
    (root / "home" / "alice" / "models" / "base").mkdir(parents=True)
    make_trainer(root / "clf", model=classifier, max_steps=2, noise_seed=None).train()  # secret noise: publishable
    make_trainer(root / "lm", model=tiny_llama(), dataset=user_dataset(causal_lm=True), max_steps=2,
                 noise_seed=None).train()
    return root


def test_a_causal_lm_card_says_text_generation_and_a_local_base_model_is_not_published(trained_cards, tmp_path):
    from huggingface_hub.repocard import metadata_load

    lm, clf = metadata_load(trained_cards / "lm" / "out" / "README.md"), trained_cards / "clf" / "out"
    assert lm["pipeline_tag"] == "text-generation"
    assert "Task: `text-generation`" in (trained_cards / "lm" / "out" / "README.md").read_text()
    text = (clf / "README.md").read_text()
    assert metadata_load(clf / "README.md")["pipeline_tag"] == "text-classification"
    assert "base_model" not in metadata_load(clf / "README.md") and "alice" not in text
    assert "Fine-tuned from a local model" in text
    check_privacy_card(clf)
    edited = tmp_path / "edited"
    edited.mkdir()
    (edited / LEDGER_FILE).write_text((clf / LEDGER_FILE).read_text())
    (edited / "README.md").write_text(text.replace("---\n", "---\nbase_model: /home/alice/models/base\n", 1))
    with pytest.raises(PrivacyCardError, match="base_model names '/home/alice/models/base', not a Hub model id"):
        check_privacy_card(edited)
    (edited / "README.md").write_text(text.replace("Fine-tuned from a local model", "Fine-tuned from `/srv/m`"))
    with pytest.raises(PrivacyCardError, match="its first sentence names '/srv/m'"):
        check_privacy_card(edited)


def _accounting(text: str) -> str:
    return text.split("### Accounting", 1)[1].split("\n##", 1)[0]


@pytest.mark.parametrize("pattern, replacement, words", [
    (r"between\s+[0-9.]+ \(lower bound\) and [0-9.]+ \(upper bound\)",
     "between 0.1 (lower bound) and 0.5 (upper bound)", "0.1 (lower bound)"),
    (r"and [0-9.]+ \(upper bound\)", "and 0.500 (upper bound)", "0.500 (upper bound)"),
    (r"estimate [0-9.]+", "estimate 0.2", "estimate 0.2"),
    (r"reaches [0-9.]+ standard", "reaches 40.00 standard", "reaches 40.00"),
    (r"= [0-9.e+-]+ to δ", "= 1e-99 to δ", "1e-99 to δ"),
    (r"\([0-9.e+-]+ from the accountant\)", "(1e-09 from the accountant)", "1e-09 from the accountant"),
], ids=["between", "upper", "estimate", "reach", "sampler-delta", "accountant-delta"])
def test_publish_refuses_an_edited_accounting_paragraph(trained_cards, tmp_path, pattern, replacement, words):
    source = trained_cards / "clf" / "out"
    text = (source / "README.md").read_text()
    section = _accounting(text)
    edited_section, count = re.subn(pattern, replacement, section, count=1)
    assert count == 1, section
    folder = tmp_path / "card"
    folder.mkdir()
    (folder / LEDGER_FILE).write_text((source / LEDGER_FILE).read_text())
    (folder / "README.md").write_text(text.replace(section, edited_section))
    with pytest.raises(PrivacyCardError, match=r"privacy section differs .*" + re.escape(words)) as error:
        check_privacy_card(folder)
    assert "\n" not in str(error.value)
