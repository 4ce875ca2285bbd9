"""hf_dp: user-level differentially private fine-tuning for the Hugging Face stack.

The core, in the order one DP step's data flows through it:

- `arguments` (`DPTrainingArguments`) and `vocabulary` (one name per concept, one table of mechanisms);
- `trainer` (`DPTrainer`), which runs: `data` (user partition, contribution bound) → `sampling` (Poisson)
  → `batching` (logical batches into micro-batches) → `losses` and `clipping` (ghost clipping per unit)
  → `noise` → `accounting` (the ledger, calibration, `accounting.planner`);
- `card` (the privacy card) and `hub` (`hf-dp publish`); `audit` (an empirical lower bound on ε).

`workflows` (corpora, tasks, the study behind `hf-dp demo`, the Gradio app) is built on the core, which imports
nothing from it, nor from `audit` (`tests/test_imports.py`). Public objects are imported on first use, so
`hf-dp plan` never loads torch. Every command line parses dataclasses with `transformers.HfArgumentParser`
(`parser`); `formatting` writes numbers the same way in the card, the plan table and the app.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "DPTrainer": "hf_dp.trainer",
    "DPTrainingArguments": "hf_dp.arguments",
    "GhostClipper": "hf_dp.clipping",
    "UnsupportedLayerError": "hf_dp.clipping",
    "PrivacyAccountant": "hf_dp.accounting",
    "epsilon": "hf_dp.accounting",
    "noise_multiplier": "hf_dp.accounting",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hf_dp' has no attribute {name!r}")
