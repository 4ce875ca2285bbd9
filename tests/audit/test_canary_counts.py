"""Audit canaries train like any user but never count in the report's, or the card's, users and examples."""
from hf_dp.audit import AuditReport, make_canaries
from hf_dp.audit.estimator import epsilon_lower_bound
from hf_dp.card import render_privacy_card, round_count
from trainer_fixtures import make_trainer, user_dataset


def test_canary_users_are_not_counted_in_the_report(tmp_path):
    canaries = make_canaries(40, 1, seed=0)
    real = user_dataset(num_users=60, max_rows=3)
    with_canaries = user_dataset(num_users=100, max_rows=3, user_ids=[f"user-{i}" for i in range(60)]
                                 + list(canaries.user_ids))
    plain = make_trainer(tmp_path / "a", dataset=real, contribution_bound=2).privacy_report()
    trainer = make_trainer(tmp_path / "b", dataset=with_canaries, contribution_bound=2)
    assert trainer.privacy_report()["num_users"] == round_count(100)  # users like any other, until the audit names them
    trainer.uncounted_user_ids = frozenset(canaries.user_ids)  # what the audit's run does
    audited = trainer.privacy_report()
    assert audited["num_users"] == plain["num_users"] == round_count(60)
    assert audited["num_examples"] == plain["num_examples"]
    assert audited["sample_rate"] < plain["sample_rate"]  # canaries are units of the mechanism: q and δ count them


def test_the_card_carries_the_audit_section(tmp_path):
    import numpy as np

    report = make_trainer(tmp_path, dataset=user_dataset(num_users=60)).privacy_report()
    included = np.arange(200) % 2 == 0
    result = epsilon_lower_bound(np.where(included, 1.0, 0.0), included, delta=0.0, guesses=(50, 50))
    audit = AuditReport(steinke=result, fdp=None, rows_per_canary=1, score="black-box",
                        epsilon_upper_bound=report["epsilon"], privacy_unit="user", mechanism="uls")
    section = audit.card_section()
    card = str(render_privacy_card(report, base_model=None, audit_section=section))
    assert card.count("## Empirical audit") == 1
    assert card.rstrip().endswith(section.strip().splitlines()[-1])
    assert "## Empirical audit" not in str(render_privacy_card(report, base_model=None))
