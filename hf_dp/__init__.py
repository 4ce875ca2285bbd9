"""hf_dp: user-level differentially private fine-tuning for the Hugging Face stack.

The core, in the order one DP step's data flows through it:

- `mechanisms` (ULS, ELS, example-level DP-SGD: registered objects that plan, account and name themselves),
  `arguments` (`DPTrainingArguments`, which select one) and `vocabulary` (one name per concept);
- `trainer` (`DPTrainerMixin`, and `DPTrainer` = the mixin on Trainer): wiring only. It runs `contribution` (G and
  the user partition, from `data`) → `privacy_plan` and `budget` (what the accountant composes, the target ε) →
  `compatibility` (checks before step 1) → `sampling` (Poisson) → `batching` (micro-batches) → `step` (`losses`,
  ghost `clipping` per unit, all-reduce + `noise`) → `releases` (scalar releases) → `checkpoint` (ledger and resume
  state); `report` (the report and the privacy card as model card);
- `sft` (`DPSFTTrainer`: the mixin on TRL's `SFTTrainer`, the `trl` extra);
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
    "DPTrainerMixin": "hf_dp.trainer",
    "DPSFTTrainer": "hf_dp.sft",
    "DPSFTConfig": "hf_dp.sft",
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
