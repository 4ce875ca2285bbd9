"""Per-unit gradient clipping for DP-SGD: ghost norms, materialised norms, book-keeping.

```python
from hf_dp.clipping import GhostClipper

clipper = GhostClipper(model)  # raises UnsupportedLayerError before any step
losses = per_example_loss(model(**batch))  # (B,)
norms = clipper.backward(losses, unit_ids=unit_ids, max_grad_norm=1.0)  # (U,)
clipper.detach()
```

One module per job: `attach` (which layers, each with its rule from `registry`), `capture` (forward
hooks), `rows` and `attribution` (whose rows are whose, first-step checks), `clip` (per-unit norms and
clipped sums, from the `terms` the rules return), `units` (examples -> units), `packing` (several examples per
row), `position_bias` (T5), and `engine` (`GhostClipper`, wiring them). The rules, one module per layer family
(`linear`, `embedding`, `norm`), are the package `rules`: a new family is a new file there, found without an
import line naming it.

`adaptive`: private adaptive clipping (Andrew et al. 2021), C tracking a quantile of the per-unit norms.
"""
from .adaptive import AdaptiveClipping, QuantileTracker, centered_unclipped_count
from .engine import GhostClipper
from .packing import examples_from_position_ids
from .registry import Rule, UnsupportedLayerError, find_rule, register_rule, registered_rules
from .terms import EXAMPLE, OUTER, ExampleGrad, GradTerm, OuterGrad

__all__ = [
    "GhostClipper",
    "examples_from_position_ids",
    "UnsupportedLayerError",
    "register_rule",
    "find_rule",
    "registered_rules",
    "Rule",
    "OuterGrad",
    "ExampleGrad",
    "GradTerm",
    "OUTER",
    "EXAMPLE",
    "AdaptiveClipping",
    "QuantileTracker",
    "centered_unclipped_count",
]
