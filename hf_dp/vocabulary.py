"""One name per concept, one table of mechanisms: what arguments, logs, report, card, CLI, app and README say.

A *mechanism* is how each step samples and clips its units (and so what the accountant composes); the word means
nothing else in hf_dp (the accountant's per-step random variable is a *privacy loss*). The user picks it with two
[`DPTrainingArguments`] fields, `privacy_unit` and `sampling`; everything downstream (the privacy plan, the report,
the card's YAML, result JSON, `hf-dp plan`'s rows, the app's tables, plots) names it by one key of [`MECHANISMS`].
Each registered mechanism ([`~hf_dp.mechanisms`]) names itself; [`MECHANISMS`], [`mechanism_of`] and the key
lists are its registry's, read here beside the other names. The built-ins:

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

# The mechanisms' names live with the mechanisms (each registered object names itself); they are read here too.
from .mechanisms import (  # noqa: F401
    DP_MECHANISMS,
    MECHANISMS,
    PRIVACY_UNITS,
    SAMPLING_SCHEMES,
    MechanismNames,
    mechanism,
    mechanism_of,
)

# Evaluation figures, one name each in card arguments, card YAML, result JSON and the app.
EVAL_KEYS = ("eval_result", "baseline_result", "non_private_result", "metric_name")
# The accountant's state beside every card and in every checkpoint: `hf-dp publish` recomputes ε from it.
LEDGER_FILE = "dp_ledger.json"
# Evaluation metrics where lower is better (the rest: higher is better).
LOWER_IS_BETTER = ("perplexity", "completion perplexity")


def lower_is_better(metric_name: str | None) -> bool:
    """Whether a smaller `metric_name` is a better model (perplexities), for plots, gaps and costs."""
    return metric_name in LOWER_IS_BETTER

