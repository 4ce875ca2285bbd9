"""Empirical privacy auditing in one training run, at the user level.

Canary users are inserted into training by independent fair coins (`make_canaries`, `insert`);
after the run each canary gets a score (`loss_scores`, `per_row_losses`), and the number of canaries
a guesser classifies correctly from the scores yields a high-confidence *lower* bound on ε
(`epsilon_lower_bound`; `fdp_epsilon_lower_bound` is a diagnostic that assumes a Gaussian trade-off curve, not a
bound for DP-SGD). A bound far below the accountant's ε is
expected (the attack is weak); a bound above it means a bug in the training step (sampling, clipping, noise)
or its accounting.

`audit_training` does all of it around a trainer you build and returns an `AuditReport`, whose
`card_section()` is the model card's "Empirical audit" section; `audit_report` turns scores from your own
training loop into the same report. White-box scores: `gradient_alignment_scores`.
"""

from hf_dp.audit.canaries import Canaries, insert, is_canary_user, make_canaries, rare_words, remove_canaries
from hf_dp.audit.estimator import AuditResult, default_guess_grid, epsilon_lower_bound, fdp_epsilon_lower_bound
from hf_dp.audit.report import AuditReport
from hf_dp.audit.run import audit_report, audit_training
from hf_dp.audit.scoring import gradient_alignment_scores, loss_scores, per_row_losses, trained_loss_scores

__all__ = [
    "AuditReport",
    "AuditResult",
    "Canaries",
    "audit_report",
    "audit_training",
    "default_guess_grid",
    "epsilon_lower_bound",
    "fdp_epsilon_lower_bound",
    "gradient_alignment_scores",
    "insert",
    "is_canary_user",
    "loss_scores",
    "make_canaries",
    "per_row_losses",
    "rare_words",
    "remove_canaries",
    "trained_loss_scores",
]
