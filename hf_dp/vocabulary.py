"""One name per concept, one table of mechanisms: what arguments, logs, report, card, CLI, app and README say.

A *mechanism* is how each step samples and clips its units (and so what the accountant composes); the word means
nothing else in hf_dp (the accountant's per-step random variable is a *privacy loss*). The user picks it with two
[`DPTrainingArguments`] fields, `privacy_unit` and `sampling`; everything downstream (the privacy plan, the report,
the card's YAML, result JSON, the planner's rows, the app's tables, plots) names it by one key of [`MECHANISMS`]:

| key | `privacy_unit` | `sampling` | each step Poisson-samples |
|---|---|---|---|
| `"uls"` | `"user"` | `"uls"` | users (`expected_batch_size` users) |
| `"els"` | `"user"` | `"els"` | examples, at most G per user |
| `"example"` | `"example"` | (unused) | examples |
| `"non-private"` | — | — | (plain fine-tuning, for comparison) |
| `"public-only"` | — | — | (no private data: the baseline) |

Field names follow [`DPTrainingArguments`] wherever a user types them: `target_epsilon`, `target_delta`,
`user_id_column`, `expected_batch_size`, `contribution_bound`, `noise_multiplier`, `max_grad_norm`; every command
line accepts them as `--target_epsilon` (or `--target-epsilon`). A folder of run results is `--results_dir`
everywhere. Evaluation figures are [`EVAL_KEYS`] in card arguments, card YAML, result JSON and the app.

Example:

```python
>>> from hf_dp.vocabulary import MECHANISMS, mechanism_of
>>> mechanism_of("user", "els")
'els'
>>> MECHANISMS["els"].label
'user-level DP, ELS'
>>> mechanism_of("example", "uls")  # sampling is unused at the example level
'example'

```
"""

from __future__ import annotations

from dataclasses import dataclass

PRIVACY_UNITS = ("user", "example")
SAMPLING_SCHEMES = ("uls", "els")


@dataclass(frozen=True)
class Mechanism:
    """How one mechanism is named and drawn everywhere."""

    key: str
    privacy_unit: str | None  # the `privacy_unit` argument; None for the two non-DP comparisons
    sampling: str | None  # the `sampling` argument; None where it is unused
    sampled_unit: str | None  # what `expected_batch_size` counts: "users" or "examples"
    label: str  # tables, plots, logs: "user-level DP, ULS"
    name: str  # headings: "ULS (user-level sampling)"
    description: str  # the report's and card's one-sentence account of a step
    marker: str = "o"
    color: str = "tab:gray"

    @property
    def is_private(self) -> bool:
        return self.privacy_unit is not None


MECHANISMS: dict[str, Mechanism] = {
    m.key: m
    for m in (
        Mechanism(
            "uls", "user", "uls", "users", "user-level DP, ULS", "ULS (user-level sampling)",
            "user-level sampling (ULS): Poisson-sampled users, per-user clipped mean gradient, Gaussian noise",
            marker="o", color="tab:blue",
        ),
        Mechanism(
            "els", "user", "els", "examples", "user-level DP, ELS",
            "ELS (example-level sampling, user-level accounting)",
            "example-level sampling (ELS): Poisson-sampled examples, per-example clipping, at most G examples "
            "per user, user-level guarantee by the mixture-of-Gaussians accountant",
            marker="s", color="tab:orange",
        ),
        Mechanism(
            "example", "example", None, "examples", "example-level DP-SGD",
            "example-level DP-SGD (protects rows, not users)",
            "DP-SGD: Poisson-sampled examples, per-example clipping, Gaussian noise (example-level guarantee)",
            marker="^", color="tab:green",
        ),
        Mechanism(
            "non-private", None, None, None, "non-private fine-tuning", "non-private fine-tuning",
            "fine-tuning without differential privacy (for comparison only)", marker="*", color="tab:red",
        ),
        Mechanism(
            "public-only", None, None, None, "public-only baseline", "public-only baseline",
            "the public model without the private data (the baseline DP has to beat)", marker="D",
            color="black",
        ),
    )
}
DP_MECHANISMS = ("uls", "els", "example")

# Evaluation figures, one name each in card arguments, card YAML, result JSON and the app.
EVAL_KEYS = ("eval_result", "baseline_result", "non_private_result", "metric_name")
# The accountant's state beside every card and in every checkpoint: `hf-dp publish` recomputes ε from it.
LEDGER_FILE = "dp_ledger.json"
# Evaluation metrics where lower is better (the rest: higher is better).
LOWER_IS_BETTER = ("perplexity", "completion perplexity")


def lower_is_better(metric_name: str | None) -> bool:
    """Whether a smaller `metric_name` is a better model (perplexities), for plots, gaps and costs."""
    return metric_name in LOWER_IS_BETTER


def mechanism_of(privacy_unit: str, sampling: str | None) -> str:
    """The key of [`MECHANISMS`] for the two arguments a user sets; a clear error for anything else."""
    if privacy_unit == "example":
        return "example"
    if privacy_unit != "user":
        raise ValueError(f"privacy_unit={privacy_unit!r}: use one of {PRIVACY_UNITS}.")
    key = str(sampling).lower()
    if key not in SAMPLING_SCHEMES:
        raise ValueError(f"sampling={sampling!r}: use one of {SAMPLING_SCHEMES} (privacy_unit='user').")
    return key


def mechanism(key: str) -> Mechanism:
    """The table entry for `key`, or one line naming the keys that exist."""
    try:
        return MECHANISMS[key]
    except KeyError:
        raise ValueError(f"mechanism={key!r}: use one of {tuple(MECHANISMS)}.") from None
