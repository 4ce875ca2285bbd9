"""hf_dp.card_check through `hf-dp publish`'s check: a card states what its run's ledger proves, and nothing more.

Two real runs of 2 steps (a tiny BERT): one with secret noise, one with a fixed `noise_seed`. Each case edits a
card the way a user or a script could — regenerating it with hf_dp's own `write_privacy_card` from an edited report
beside the true ledger, or adding text — and publish must refuse it, in one line, before any upload.
"""
from __future__ import annotations

import json
import math
import re

import huggingface_hub
import numpy as np
import pytest

from hf_dp import hub as publish_module
from hf_dp.card import LEDGER_FILE, write_privacy_card
from hf_dp.card_label import NO_GUARANTEE_BANNER
from hf_dp.hub import PrivacyCardError, check_privacy_card, publish


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"secret": (report, ledger), "fixed": (report, ledger)}: what two trained runs' trainers return."""
    from trainer_fixtures import make_trainer

    root = tmp_path_factory.mktemp("runs")
    found = {}
    for name, seed in (("secret", None), ("fixed", 1234)):
        trainer = make_trainer(root / name, max_steps=2, noise_seed=seed, contribution_bound=2)
        trainer.train()
        found[name] = (trainer.privacy_report(), trainer.privacy_ledger())
    return found


def card(folder, report, ledger, **kwargs):
    write_privacy_card(report, folder, ledger=ledger, base_model="test/tiny", eval_result=0.7, baseline_result=0.4,
                       **kwargs)
    return folder


def refused(folder, match, **kwargs) -> str:
    with pytest.raises(PrivacyCardError, match=match) as error:
        check_privacy_card(folder, **kwargs)
    assert "\n" not in str(error.value)
    return str(error.value)


def test_the_true_card_of_a_run_with_secret_noise_is_accepted(runs, tmp_path):
    report, ledger = runs["secret"]
    assert "report" in ledger and ledger["report"]["noise_multiplier"] == report["noise_multiplier"]
    privacy = check_privacy_card(card(tmp_path, report, ledger))
    assert privacy["epsilon"] == pytest.approx(report["epsilon"]) and "no_guarantee" not in privacy


@pytest.mark.parametrize("change, figure", [
    ({"noise_multiplier": 5.0}, "noise_multiplier = 5.0"),
    ({"max_grad_norm": 0.01}, "max_grad_norm = 0.01"),
    ({"contribution_bound": 1}, "contribution_bound = 1"),
    ({"num_users": 100_000}, "num_users = 100000"),
    ({"num_examples": 10**6}, "num_examples = 1000000"),
    ({"target_epsilon": 1.0}, "target_epsilon = 1.0"),
    ({"sample_rate": 0.001}, "sample_rate = 0.001"),
    ({"expected_batch_size": 800}, "expected_batch_size = 800"),
    ({"epsilon": 20.0}, "epsilon = 20.0"),  # overstated: not what the ledger proves either
    ({"noise_source": "cryptographic: a quantum source"}, "noise_source = 'cryptographic"),
    ({"accountant": "Rényi DP"}, "accountant = 'Rényi DP'"),
    ({"certified": True}, "states certified = True, which its ledger does not record"),
], ids=lambda value: next(iter(value)) if isinstance(value, dict) else None)
def test_a_card_regenerated_from_an_edited_report_is_refused(runs, tmp_path, change, figure):
    """hf_dp's own write_privacy_card, the true ledger beside it: every figure of the block is the ledger's."""
    report, ledger = runs["secret"]
    message = refused(card(tmp_path, {**report, **change}, ledger), re.escape(figure))
    assert "its ledger proves" in message or "does not record" in message
    assert "--no_guarantee" in message


def test_a_regenerated_card_with_other_steps_or_mechanism_is_refused(runs, tmp_path):
    report, ledger = runs["secret"]
    refused(card(tmp_path / "steps", {**report, "steps": 40}, ledger), "steps = 40")
    els = {**report, "mechanism": "els", "sampling": "els"}
    refused(card(tmp_path / "els", els, ledger), "mechanism = 'els'")


def test_a_fixed_seed_run_says_no_guarantee_and_is_refused_without_the_flag(runs, tmp_path):
    report, ledger = runs["fixed"]
    assert report["no_guarantee"] is True and "OS entropy" not in report["noise_source"]
    assert "noise_seed=1234 (NOT a secret" in report["noise_source"]
    folder = card(tmp_path, report, ledger)
    text = (folder / "README.md").read_text()
    assert "Training satisfies" not in text and "**it carries NO privacy guarantee**" in text
    refused(folder, "carries NO privacy guarantee .* --no_guarantee")
    assert check_privacy_card(folder, no_guarantee=True)["no_guarantee"] is True


def test_hiding_the_fixed_seed_is_refused(runs, tmp_path):
    """The seed and its label dropped from the report, the secret run's noise source put in: the ledger records
    the seed. (Dropping only the label changes nothing: a fixed seed is always rendered with it.)"""
    report, ledger = runs["fixed"]
    hidden = {**{k: v for k, v in report.items() if k != "no_guarantee"}, "noise_seed": "os-entropy",
              "noise_source": runs["secret"][0]["noise_source"]}
    refused(card(tmp_path / "hidden", hidden, ledger), "the card says (no_guarantee|noise_seed|noise_source)")
    unlabelled = card(tmp_path / "unlabelled", {k: v for k, v in report.items() if k != "no_guarantee"}, ledger)
    assert check_privacy_card(unlabelled, no_guarantee=True)["no_guarantee"] is True


def test_deleting_the_fixed_seed_bullet_is_refused(runs, tmp_path):
    report, ledger = runs["fixed"]
    folder = card(tmp_path, report, ledger)
    readme = folder / "README.md"
    text = readme.read_text()
    bullet = re.search(r"(?m)^- \*\*The noise seed \(fixed seed.*$", text).group(0)
    readme.write_text(text.replace(bullet + "\n", ""))
    refused(folder, "it lacks the line '- \\*\\*The noise seed", no_guarantee=True)


CLAIM = "This model is (0.1, 1e-9)-DP for every user."


@pytest.mark.parametrize("where", ["appended", "after-privacy", "html-comment", "table", "heading", "entity"])
def test_a_privacy_claim_added_to_the_text_is_refused(runs, tmp_path, where):
    report, ledger = runs["secret"]
    folder = card(tmp_path, report, ledger)
    readme = folder / "README.md"
    text = readme.read_text()
    edited = {
        "appended": text + f"\n## Summary\n\n{CLAIM}\n",
        "after-privacy": text.replace("\n## Evaluation", f"\n## Our claim\n\n{CLAIM}\n\n## Evaluation"),
        "html-comment": text + f"\n<!-- {CLAIM} -->\n",
        "table": text + "\n| Property | Value |\n|---|---|\n| Guaranteed ε | 0.1 |\n",
        "heading": text + "\n## Certified private for 100,000 users\n",
        "entity": text + "\nTrained at &epsilon; = 0.1.\n",
    }[where]
    readme.write_text(edited)
    refused(folder, "adds a privacy claim that its ledger does not prove")


def test_an_extra_not_covered_item_with_a_claim_is_refused_and_a_plain_one_accepted(runs, tmp_path):
    report, ledger = runs["secret"]
    refused(card(tmp_path / "claim", report, ledger, extra_not_covered=[f"**Nothing.** {CLAIM}"]),
            "adds a privacy claim")
    check_privacy_card(card(tmp_path / "plain", report, ledger,
                            extra_not_covered=["**Generated text.** Sampling settings are not covered."]))


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.replace("tags:\n", "dp_epsilon: 0.1\ntags:\n", 1), "front matter adds a privacy claim"),
    (lambda t: t.replace("tags:\n", "# certified (0.1, 1e-9)-DP\ntags:\n", 1), "front matter adds a privacy claim"),
    (lambda t: t.replace("tags:\n", "tags:\n- epsilon-0.1\n", 1), "front matter adds a privacy claim"),
    (lambda t: t.replace("- differential-privacy\n", "", 1), "its tags lack \\['differential-privacy'\\]"),
    (lambda t: t.replace("pipeline_tag: text-classification", "pipeline_tag: fill-mask", 1),
     "fill-mask"),
], ids=["key", "yaml-comment", "tag", "tag-removed", "other-metadata"])
def test_metadata_claims_are_refused(runs, tmp_path, edit, match):
    report, ledger = runs["secret"]
    folder = card(tmp_path, report, ledger)
    readme = folder / "README.md"
    readme.write_text(edit(readme.read_text()))
    refused(folder, match)


def test_plain_additions_are_accepted(runs, tmp_path):
    """A section with no privacy claim, and the metadata create_model_card adds, are the user's to write."""
    from hf_dp.report import add_card_metadata

    report, ledger = runs["secret"]
    folder = card(tmp_path, report, ledger)
    add_card_metadata(folder / "README.md", language="en", license="apache-2.0", tags=["shakespeare"])
    readme = folder / "README.md"
    readme.write_text(readme.read_text() + "\n## Intended use\n\nA demonstration of the library; not for production.\n")
    check_privacy_card(folder)


def test_an_edited_ledger_report_is_refused(runs, tmp_path):
    """σ edited in the ledger and the card alike: σ no longer composes to the σ_eff the accountant used."""
    report, ledger = runs["secret"]
    edited = json.loads(json.dumps(ledger))
    edited["report"]["noise_multiplier"] = 5.0
    refused(card(tmp_path / "sigma", {**report, "noise_multiplier": 5.0}, edited), "composes to σ_eff")
    edited = json.loads(json.dumps(ledger))
    edited["report"]["sample_rate"] = 0.001
    refused(card(tmp_path / "q", {**report, "sample_rate": 0.001}, edited), "segment 0 has \\(q, σ_eff, group size\\)")
    stale = {key: value for key, value in ledger.items() if key != "report"}
    refused(card(tmp_path / "old", report, stale), "written before hf_dp checked every figure")


def test_publish_no_guarantee_uploads_a_labelled_card_and_leaves_the_folder_alone(runs, tmp_path, monkeypatch):
    from app_fixtures import tiny_classifier

    calls = []

    class Recorder:
        def __init__(self, token=None, endpoint=None, **kwargs):
            self.endpoint = "http://127.0.0.1:9"

        def create_repo(self, repo_id, **kwargs):
            return huggingface_hub.RepoUrl(f"https://hub.test/{repo_id}", endpoint="https://hub.test")

        def upload_file(self, **kwargs):
            calls.append(("upload_file", kwargs))

        def upload_folder(self, **kwargs):
            calls.append(("upload_folder", kwargs))

    monkeypatch.setattr(huggingface_hub, "HfApi", Recorder)
    monkeypatch.setattr(publish_module, "ensure_hub_reachable", lambda *a, **k: None)
    report, ledger = runs["secret"]
    folder = card(tmp_path, {**report, "noise_multiplier": 5.0}, ledger)  # figures its ledger does not prove
    tiny_classifier(0, 20).save_pretrained(folder)
    original = (folder / "README.md").read_text()
    with pytest.raises(PrivacyCardError, match="noise_multiplier = 5.0"):
        publish(folder, "alice/m", token="t")
    assert calls == []
    publish(folder, "alice/m", token="t", no_guarantee=True)
    (_, readme_upload), (_, folder_upload) = calls
    uploaded = readme_upload["path_or_fileobj"].decode()
    assert readme_upload["path_in_repo"] == "README.md" and "README.md" in folder_upload["ignore_patterns"]
    metadata = huggingface_hub.ModelCard(uploaded).data.to_dict()
    assert metadata["privacy"]["no_guarantee"] is True and "no-privacy-guarantee" in metadata["tags"]
    assert "differential-privacy" not in metadata["tags"]
    assert huggingface_hub.ModelCard(uploaded).text.lstrip().startswith(NO_GUARANTEE_BANNER)
    assert "WITHOUT a privacy guarantee" in readme_upload["commit_message"]
    assert (folder / "README.md").read_text() == original
    (folder / LEDGER_FILE).unlink()  # even a card with no ledger at all goes up only labelled
    calls.clear()
    publish(folder, "alice/m", token="t", no_guarantee=True)
    assert calls[0][1]["path_or_fileobj"].decode().count(NO_GUARANTEE_BANNER) == 1


# ---- the "Empirical audit" section: what the audit report beside the card (dp_audit.json) renders ----------------


def audit_of(report, *, upper="run", flip=0.1, **kwargs):
    """An audit report of 256 canaries whose scores separate the coins but for a fraction `flip`, against the run's
    ε (or `upper`), for the run's mechanism and unit."""
    from hf_dp.audit import audit_report

    rng = np.random.default_rng(0)
    included = rng.random(256) < 0.5
    scores = (included ^ (rng.random(256) < flip)).astype(float) + 1e-9 * rng.random(256)
    return audit_report(scores, included, delta=1e-5, score="black-box",
                        epsilon_upper_bound=report["epsilon"] if upper == "run" else upper,
                        **{"privacy_unit": report["privacy_unit"], "mechanism": report["mechanism"], **kwargs})


def audited(folder, report, ledger, audit, *, audited_model=True):
    """The run's card with `audit`'s section, written as `hf-dp audit` writes it (AuditReport.write_to_card)."""
    card(folder, report, ledger)
    audit.write_to_card(folder, audited_model=audited_model)
    return folder


@pytest.mark.parametrize("audited_model", [True, False], ids=["this-run", "separate-run"])
def test_an_audit_section_written_by_write_to_card_is_accepted(runs, tmp_path, audited_model):
    """The report beside the card renders the section; a separate run's audit adds the not-covered item on how the
    two runs compose, this run's own audit does not (scoring it is post-processing). Rewriting with the other flag
    swaps both."""
    from hf_dp.audit.record import AUDIT_FILE

    report, ledger = runs["secret"]
    audit = audit_of(report)
    folder = audited(tmp_path, report, ledger, audit, audited_model=audited_model)
    check_privacy_card(folder)
    assert json.loads((folder / AUDIT_FILE).read_text()) == {**audit.to_dict(), "audited_model": audited_model}
    composition = "**The empirical audit below, with this model.**"
    text = (folder / "README.md").read_text()
    assert text.count("## Empirical audit") == 1 and (composition in text) is not audited_model
    audit.write_to_card(folder, audited_model=not audited_model)
    check_privacy_card(folder)
    text = (folder / "README.md").read_text()
    assert text.count("## Empirical audit") == 1 and text.count(composition) == int(audited_model)
    assert not list(folder.glob("*.tmp")) and not list(folder.glob(".*.tmp"))


def _failing(text: str) -> str:
    """A failed audit's section made to read as passed: the warning gone, the verdict sentence replaced."""
    lines = [line for line in text.splitlines() if not line.startswith("**WARNING: the audit FAILED")]
    passed = ("A lower bound well below the proven ε is expected: the canaries and the guesser are far weaker than "
              "the worst case the proof covers.")
    return "\n".join(passed if line.startswith("**The audit FAILED") else line for line in lines) + "\n"


@pytest.mark.parametrize("edit, match", [
    (lambda t, lower: t + f"\n{CLAIM}\n", "adds the line 'This model is"),
    (lambda t, lower: t.replace("| Audit | Value |", f"{CLAIM}\n\n| Audit | Value |"), "it says 'This model is"),
    (lambda t, lower: t.replace("| δ of the bounds", "| Proven ε for every user | 0.1 |\n| δ of the bounds"),
     "it says '\\| Proven ε for every user"),
    (lambda t, lower: t.replace(f"**{lower}**", "**0.00**"), "it says '.*\\*\\*0.00\\*\\*"),
    (lambda t, lower: t.replace("| Proven upper bound on ε (the accountant) | 8.00 |",
                                "| Proven upper bound on ε (the accountant) | 0.10 |"), "0.10"),
    (lambda t, lower: t.replace("this model's own training run", "a separate training run"), "a separate training"),
    (lambda t, lower: t[: t.index("**What it does not show.**")], "it ends where the report gives"),
], ids=["claim-appended", "claim-inside", "table-row", "lower-bound", "proven-epsilon", "which-run", "caveat-cut"])
def test_an_edited_audit_section_is_refused(runs, tmp_path, edit, match):
    report, ledger = runs["secret"]
    audit = audit_of(report)
    folder = audited(tmp_path, report, ledger, audit)
    readme = folder / "README.md"
    lower = f"{math.floor(audit.epsilon_lower_bound * 100) / 100:.2f}"
    edited = edit(readme.read_text(), lower)
    assert edited != readme.read_text()
    readme.write_text(edited)
    message = refused(folder, f'"Empirical audit" section .*{match}')
    assert "AuditReport.write_to_card" in message and "hf-dp audit" in message and "--no_guarantee" in message


def test_a_failed_audit_edited_to_read_as_passed_is_refused(runs, tmp_path):
    """A separate run whose audit refutes its ε = 1: the warning dropped and the verdict rewritten in the card, or
    the report's verdict and audit_failed edited with the section rendered from the true report."""
    from hf_dp.audit.record import AUDIT_FILE

    report, ledger = runs["secret"]
    audit = audit_of(report, upper=1.0, flip=0.0)
    assert audit.failed
    folder = audited(tmp_path, report, ledger, audit, audited_model=False)
    readme = folder / "README.md"
    original = readme.read_text()
    readme.write_text(_failing(original))
    refused(folder, '"Empirical audit" section differs .* it says \'An empirical check')
    readme.write_text(original)
    check_privacy_card(folder)
    record = json.loads((folder / AUDIT_FILE).read_text())
    for key, value in (("verdict", "the audit passed: lower bound 3.16 <= proven ε 8.00 (ceiling 3.16)"),
                       ("audit_failed", False)):
        (folder / AUDIT_FILE).write_text(json.dumps({**record, key: value}))
        refused(folder, f"says {key} = .* but its own figures give .*: the file was edited")


def test_a_section_without_its_audit_report_is_refused(runs, tmp_path):
    """No dp_audit.json: a section written with write_privacy_card(audit_section=...) or the file deleted; a file
    that is not JSON."""
    from hf_dp.audit.record import AUDIT_FILE

    report, ledger = runs["secret"]
    audit = audit_of(report)
    by_string = card(tmp_path / "string", report, ledger, audit_section=audit.card_section())
    refused(by_string, f"has an \"Empirical audit\" section but no audit report beside it \\({AUDIT_FILE}\\)")
    folder = audited(tmp_path / "deleted", report, ledger, audit)
    (folder / AUDIT_FILE).unlink()
    refused(folder, "no audit report beside it")
    (folder / AUDIT_FILE).write_text("{not json")
    refused(folder, f"its audit report \\({AUDIT_FILE}\\) is not JSON")
    (folder / AUDIT_FILE).write_text("[]")
    refused(folder, "holds a list, not a report")


def _report_edits():
    import dataclasses

    def steinke(**changes):
        return lambda audit: dataclasses.replace(audit, steinke=dataclasses.replace(audit.steinke, **changes))

    return [
        (steinke(epsilon_lower_bound=0.5), True, "states the lower bound 0.5, which"),
        (lambda a: steinke(epsilon_lower_bound=a.epsilon_lower_bound + 0.3)(a), True, "states the lower bound"),
        (lambda a: steinke(correct=sum(a.steinke.guesses) + 1)(a), True, "has counts no audit gives"),
        (lambda a: steinke(correct=a.steinke.correct - 20)(a), True, "states the lower bound"),
        (lambda a: dataclasses.replace(a, epsilon_ceiling=9.0), True, "has ceiling 9.0, but 256 canaries"),
        (lambda a: dataclasses.replace(a, epsilon_upper_bound=100.0), True, "tested ε = 100.0 on this model's own run"),
        (lambda a: dataclasses.replace(a, epsilon_upper_bound=0.1), True, "tested ε = 0.1 on this model's own run"),
        (lambda a: dataclasses.replace(a, epsilon_upper_bound=50.0), False, "above the target ε = 8"),
        (lambda a: dataclasses.replace(a, mechanism="els"), True, "audited a run with mechanism = 'els'"),
        (lambda a: dataclasses.replace(a, privacy_unit="example"), False, "with privacy_unit = 'example'"),
        (lambda a: dataclasses.replace(a, mechanism="non-private", epsilon_upper_bound=None), False,
         "mechanism = 'non-private'"),
        (lambda a: dataclasses.replace(a, score=f"black-box. {CLAIM}"), True, "has score = 'black-box. This model"),
    ]


@pytest.mark.parametrize("change, audited_model, match", _report_edits(), ids=[
    "lower-bound-down", "lower-bound-up", "correct-impossible", "correct-down", "ceiling", "epsilon-up",
    "epsilon-down", "separate-above-target", "mechanism", "unit", "non-private", "score-text"])
def test_an_audit_report_edited_and_its_section_regenerated_is_refused(runs, tmp_path, change, audited_model, match):
    """The strongest edit a user can make with hf_dp's own code: an edited AuditReport written with write_to_card,
    so section and file agree. Its figures must still follow from one another and from the ledger."""
    report, ledger = runs["secret"]
    folder = audited(tmp_path, report, ledger, change(audit_of(report)), audited_model=audited_model)
    message = refused(folder, match)
    assert "AuditReport.write_to_card" in message and "--no_guarantee" in message


def test_the_audited_model_flag_is_recorded_as_a_boolean(runs, tmp_path):
    from hf_dp.audit.record import AUDIT_FILE

    report, ledger = runs["secret"]
    folder = audited(tmp_path, report, ledger, audit_of(report))
    record = json.loads((folder / AUDIT_FILE).read_text())
    (folder / AUDIT_FILE).write_text(json.dumps({**record, "audited_model": "yes"}))
    refused(folder, "records audited_model = 'yes'")


def test_a_claim_after_the_audit_section_is_refused(runs, tmp_path):
    """A section after the audit's is the card's own: its lines are checked for claims."""
    report, ledger = runs["secret"]
    folder = audited(tmp_path, report, ledger, audit_of(report))
    readme = folder / "README.md"
    readme.write_text(readme.read_text() + f"\n## Summary\n\n{CLAIM}\n")
    refused(folder, "adds a privacy claim")


def test_an_edited_audit_section_goes_up_only_labelled_as_carrying_no_guarantee(runs, tmp_path, monkeypatch):
    from app_fixtures import tiny_classifier

    uploads = []

    class Recorder:
        endpoint = "http://127.0.0.1:9"

        def __init__(self, token=None, **kwargs):
            pass

        def create_repo(self, repo_id, **kwargs):
            return huggingface_hub.RepoUrl(f"https://hub.test/{repo_id}", endpoint="https://hub.test")

        def upload_file(self, **kwargs):
            uploads.append(kwargs["path_or_fileobj"].decode())

        def upload_folder(self, **kwargs):
            uploads.append(kwargs["ignore_patterns"])

    monkeypatch.setattr(huggingface_hub, "HfApi", Recorder)
    monkeypatch.setattr(publish_module, "ensure_hub_reachable", lambda *a, **k: None)
    report, ledger = runs["secret"]
    folder = audited(tmp_path, report, ledger, audit_of(report))
    tiny_classifier(0, 20).save_pretrained(folder)
    readme = folder / "README.md"
    readme.write_text(readme.read_text() + f"{CLAIM}\n")
    with pytest.raises(PrivacyCardError, match='"Empirical audit" section adds the line'):
        publish(folder, "alice/m", token="t")
    assert uploads == []
    publish(folder, "alice/m", token="t", no_guarantee=True)
    assert uploads[0].count(NO_GUARANTEE_BANNER) == 1 and "README.md" in uploads[1]
