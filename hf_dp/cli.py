"""The `hf-dp` command (also `python -m hf_dp`).

Subcommands:

- `hf-dp demo`: the privacy/utility study on the embedded default (see `hf_dp.workflows.study`).
- `hf-dp app`: the Gradio app (see `hf_dp.workflows.app`); `hf-dp publish`: push a run with its privacy card.
- `hf-dp audit`: an empirical privacy audit, an ε lower bound beside the proven ε (see `hf_dp.workflows.audit_demo`).
- `hf-dp plan`: the privacy mechanism table. For ULS, ELS (mixture-of-Gaussians accountant) and
  example-level DP-SGD at the same compute budget (`--examples_per_step`): the noise multiplier σ each
  needs for a target (ε, δ), the ε each spends at a fixed σ, the recommended contribution bound G, the
  sample rate, the `expected_batch_size` to train with (in its unit: users for ULS, examples otherwise)
  and the steps.

    hf-dp plan --users 1000 --examples_per_user 20 --examples_per_step 64 --steps 300 --target_epsilon 4
    hf-dp plan --data train.jsonl --user_id_column author --examples_per_step 256 --noise_multiplier 1.0

  With `--data`, the plan reads two numbers from the private file: the number of users and an ε-DP
  median of the examples per user (`--data_epsilon`, default 0.1); it prints no exact count statistic.

Every command's flags are the fields of a dataclass parsed by `transformers.HfArgumentParser`
([`hf_dp.command_line.ArgumentParser`]), spelled like the `DPTrainingArguments` fields they stand for
(`--target_epsilon`, `--target_delta`, `--user_id_column`, `--noise_multiplier`, `--contribution_bound`); every flag
also accepts dashes (`--target-epsilon`). Bad input, and a command whose optional dependencies are not installed
(`pip install 'hf_dp[demo]'`, `'hf_dp[app]'`), print one line saying what to change on stderr and exit with
status 2.

New subcommands: a module with an arguments dataclass and `run(arguments) -> int`, listed in `_MODULE_COMMANDS`
(the module must import nothing heavy at import time: `hf-dp --help` imports it).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections import Counter
from dataclasses import dataclass, field

from .command_line import ArgumentParser, MissingExtraError, check_numbers

__all__ = ["PlanDataArguments", "PlanRunArguments", "build_parser", "format_plan", "main"]


def build_parser() -> ArgumentParser:
    """The `hf-dp` parser: one subparser per command (an `ArgumentParser` over its arguments dataclasses), each
    with `func` set to its handler and `command_parser` to itself."""
    parser = ArgumentParser(prog="hf-dp", one_line_errors=True,
                            description="User-level differentially private fine-tuning on the Hugging Face stack.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_command(subparsers, "plan", (PlanDataArguments, PlanRunArguments), _cmd_plan, *_PLAN_HELP)
    for name, (module_name, arguments_name, help_text, description) in _MODULE_COMMANDS.items():
        module = importlib.import_module(f".{module_name}", __package__)  # light: heavy imports wait for `run`
        _add_command(subparsers, name, getattr(module, arguments_name), module.run, help_text, description)
    return parser


def _add_command(subparsers, name: str, dataclass_types, func, help_text: str, description: str) -> None:
    command = subparsers.add_parser(name, dataclass_types=dataclass_types, one_line_errors=True, help=help_text,
                                    description=description, formatter_class=argparse.HelpFormatter)
    command.set_defaults(func=func, command_parser=command)


def main(argv: list[str] | None = None) -> int:
    """Run `hf-dp` with `argv` (default: the process arguments); returns the exit status."""
    parser = build_parser()
    namespace = parser.parse_args(argv)
    try:
        return namespace.func(*namespace.command_parser.dataclasses_from(namespace)) or 0
    except (MissingExtraError, ValueError, OSError) as error:
        message = " ".join(str(error).split())  # one line
        print(f"{parser.prog} {namespace.command}: error: {message}", file=sys.stderr)
        return 2


# ---- hf-dp demo / app / publish / audit (flags and behaviour: the module named) ----------------------------

# name -> (module, its arguments dataclass, help, description); each module also has `run(arguments)`.
_MODULE_COMMANDS = {
    "demo": ("workflows.study", "StudyArguments",
             "the privacy/utility study on the embedded default (SmolLM2 chat fine-tuning; --task causal_lm, "
             "--task classification)",
             "Public-only baseline, user-level DP (ULS) at ε = 8, 3 and 1 with adaptive clipping and non-private chat "
             "fine-tuning (TRL's SFTTrainer, LoRA) of the embedded SmolLM2-135M-Instruct on Shakespeare "
             "conversations by role; --task causal_lm: next-token prediction; --task classification: the embedded "
             "MiniLM on the Folio genre; --grid runs the full study, --seeds N repeats the headline runs."),
    "app": ("workflows.app", "AppArguments",
            "Gradio app: mechanism table, a short DP run, DP vs public-only baseline, privacy cards",
            "Serve the Gradio app on --host:--port over the runs in --results_dir."),
    "publish": ("hub", "PublishArguments",
                "upload a saved model, its tokenizer and its privacy card (README.md) to the Hub",
                "Upload a saved model, its tokenizer and its privacy card to the Hub; checks the card and that the "
                "Hub is reachable before uploading anything."),
    "audit": ("workflows.audit_demo", "AuditArguments",
              "empirical privacy audit: an ε lower bound from canary users beside the proven ε",
              "One-run privacy audit (Steinke, Nasr & Jagielski 2023) of the demo's ULS run (the chat study's "
              "DPSFTTrainer run on SmolLM2; --task classification: the MiniLM study's): canary users added by fair "
              "coins, trained at --target_epsilon, scored; prints the ε lower bound beside the accountant's ε and "
              "writes --results_dir/audit.json."),
}


# ---- hf-dp plan -------------------------------------------------------------------------------

_PLAN_HELP = (
    "σ, ε, contribution bound G and expected_batch_size for ULS, ELS and example-level DP-SGD",
    "Plan a DP fine-tuning run: for ULS, ELS (mixture-of-Gaussians accountant) and example-level "
    "DP-SGD at the same compute budget, the noise multiplier σ each needs to meet (ε, δ), the ε "
    "each spends at a fixed σ, the recommended contribution bound G, the sample rate, the "
    "expected_batch_size to train with and the steps. Flags are DPTrainingArguments' field names "
    "(dashes also accepted).",
)


@dataclass
class PlanDataArguments:
    """`hf-dp plan`: the population, given as numbers or read from a data file."""

    _argument_group_name = "data (either --users with --examples_per_user, or --data)"

    users: int | None = field(default=None, metadata={"help": "number of users (at least 2)"})
    examples_per_user: int | None = field(default=None, metadata={"help": "examples (rows) of every user"})
    data: str | None = field(default=None,
                             metadata={"help": "a .csv, .jsonl/.json or .parquet file with one example per row"})
    user_id_column: str | None = field(default=None, metadata={"help": "the column of --data holding the user id"})
    data_epsilon: float = field(
        default=0.1,
        metadata={"help": "ε of the DP median of --data's examples per user, the only statistic the plan reads from "
                          "it besides the number of users (exponential mechanism on a public grid; spent by this "
                          "plan, in no run's ledger). Default: 0.1"})

    def __post_init__(self):
        check_numbers(self, {"examples_per_user": "int>=1", "data_epsilon": "float>0"})
        if self.users is not None and not (isinstance(self.users, int) and self.users >= 2):
            raise ValueError(f"--users {self.users}: DPTrainer refuses training data with fewer than 2 users (a "
                             "user-level guarantee needs many users); give the number of users you will train on.")
        if self.data is not None:
            if self.users is not None or self.examples_per_user is not None:
                raise ValueError("give either --data (with --user_id_column) or --users with --examples_per_user, "
                                 "not both.")
            if not self.user_id_column:
                raise ValueError("--data needs --user_id_column (the column with the user id).")
        elif self.users is None or self.examples_per_user is None:
            raise ValueError("give --users and --examples_per_user, or --data with --user_id_column.")


@dataclass
class PlanRunArguments:
    """`hf-dp plan`: the run to plan (flags named as the `DPTrainingArguments` fields they stand for)."""

    _argument_group_name = "run"

    examples_per_step: float = field(
        default=64.0,
        metadata={"help": "compute budget: expected examples processed per step, the same for every mechanism (ELS "
                          "and example-level sample expected_batch_size = this many examples; ULS samples this many "
                          "examples' worth of users). Default: 64"})
    steps: int | None = field(default=None,
                              metadata={"help": "optimizer steps. Default: one expected pass over the examples"})
    target_epsilon: float | None = field(
        default=8.0, metadata={"help": "target ε the plan calibrates σ to (None is refused: give one). Default: 8"})
    target_delta: float | None = field(
        default=None,
        metadata={"help": "δ, below 1/users. Default: 1/(10·users) for the user-level rows and 1/(10·examples) for "
                          "the example-level row (the defaults of DPTrainingArguments)"})
    noise_multiplier: float | None = field(
        default=None, metadata={"help": "also report the ε each mechanism spends at this fixed σ"})
    contribution_bound: int | str | None = field(
        default=None,
        metadata={"help": "G, the most examples kept per user, for ULS and ELS: a whole number, or auto (the "
                          "default): the median examples per user for ELS, the noise-prediction heuristic (Charles "
                          "et al. 2024) for ULS, as DPTrainer's contribution_bound='auto' chooses"})
    adaptive_clipping: bool = field(
        default=False,
        metadata={"help": "plan for private adaptive clipping (Andrew et al. 2021): σ is then the gradient noise "
                          "multiplier DPTrainer calibrates, which leaves room for the noised count of unclipped "
                          "units each step releases"})
    clipping_count_noise: float | None = field(
        default=None,
        metadata={"help": "σ_b, the noise std of adaptive clipping's count, in units. Default: expected_batch_size / "
                          "20, as DPTrainer (only with --adaptive_clipping)"})
    trainable_parameters: int = field(
        default=10**11,
        metadata={"help": "the model's trainable parameters (values noised each step), for what the noise "
                          "sampler's finite support adds to δ. Default: 1e11, above any model fine-tuned today"})

    def __post_init__(self):
        if self.target_epsilon is None:
            raise ValueError("--target_epsilon None: hf-dp plan calibrates σ to a target ε; --noise_multiplier adds "
                             "the ε each mechanism spends at that fixed σ beside it; give a target (default 8).")
        self.contribution_bound = _plan_contribution_bound(self.contribution_bound)
        check_numbers(self, {"examples_per_step": "float>0", "steps": "int>=1", "target_epsilon": "float>0",
                             "target_delta": "(0,1)", "noise_multiplier": "float>0", "contribution_bound": "int>=1",
                             "clipping_count_noise": "float>0", "trainable_parameters": "int>=1"})


def _plan_contribution_bound(value):
    """`--contribution_bound` as `compare` takes it: None for `auto` (the default choice), else a whole number."""
    if value is None or isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip()
    if text.lower() == "auto":
        return None
    if text.isdigit():
        return int(text)
    raise ValueError(f"--contribution_bound {value!r}: use a whole number >= 1 (G, the most examples kept per "
                     "user), or auto (the default: the median examples per user for ELS, the noise-prediction "
                     "heuristic for ULS).")


def _read_examples_per_user(path: str, column: str) -> list[int]:
    """Rows per user in a data file (rows without a user id are ignored)."""
    import pandas as pd

    if not os.path.isfile(path):
        raise ValueError(f"--data {path!r}: no such file.")
    name = path.lower()
    readers = {".csv": pd.read_csv, ".tsv": lambda p: pd.read_csv(p, sep="\t"), ".parquet": pd.read_parquet,
               ".jsonl": lambda p: pd.read_json(p, lines=True), ".json": _read_json_table}
    suffix = next((s for s in readers if name.endswith(s)), None)
    if suffix is None:
        raise ValueError(f"--data {path!r}: use a .csv, .tsv, .jsonl, .json or .parquet file.")
    counts = _arrow_examples_per_user(path, suffix, column)
    if counts is not None:
        return counts
    try:
        frame = readers[suffix](path)
    except Exception as error:  # pandas raises many types for malformed files
        raise ValueError(f"--data {path!r} could not be read as {suffix[1:]}: {error}") from error
    if column not in frame.columns:
        shown = ", ".join(map(str, list(frame.columns)[:10]))
        raise ValueError(f"--user_id_column {column!r} is not a column of {path} (columns: {shown}).")
    ids = frame[column].dropna()
    if ids.empty:
        raise ValueError(f"--data {path}: no row has a value in --user_id_column {column!r}.")
    return sorted(Counter(ids.tolist()).values())


# The fields pandas' read_csv reads as missing (its default na_values): pyarrow's CSV reader is told the same.
PANDAS_NA_VALUES = ["", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN", "<NA>",
                    "N/A", "NA", "NULL", "NaN", "None", "n/a", "nan", "null"]


def _arrow_examples_per_user(path: str, suffix: str, column: str) -> list[int] | None:
    """Rows per user read with pyarrow (the user column only, where the format allows) and counted in Arrow; `None`
    where pandas must decide (a file pyarrow cannot read, no such column, ids that are not strings, integers or
    booleans): the pandas path then gives the same counts, or the error, at pandas' speed."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(path, columns=[column])
        elif suffix in (".csv", ".tsv"):
            from pyarrow import csv

            convert = csv.ConvertOptions(include_columns=[column], null_values=PANDAS_NA_VALUES,
                                         strings_can_be_null=True)
            table = csv.read_csv(path, parse_options=csv.ParseOptions(delimiter="\t" if suffix == ".tsv" else ","),
                                 convert_options=convert)
        elif suffix == ".jsonl":
            from pyarrow import json

            table = json.read_json(path)
        else:
            return None
    except Exception:  # noqa: BLE001 - pandas reads it, or says what is wrong
        return None
    if column not in table.column_names:
        return None
    ids = table.column(column)
    kind = ids.type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_integer(kind)
            or pa.types.is_boolean(kind)):
        return None  # floats (NaN, -0.0), lists, mixed types: pandas' Counter decides
    counts = pc.value_counts(ids.drop_null()).field("counts").to_numpy()
    if not len(counts):
        return None  # pandas says no row has a value
    return np.sort(counts).tolist()


def _read_json_table(path: str):
    """A .json data file as a frame: a JSON array of rows, or JSON lines."""
    import pandas as pd

    try:
        return pd.read_json(path)
    except ValueError:
        return pd.read_json(path, lines=True)


def _cmd_plan(data: PlanDataArguments, run: PlanRunArguments) -> int:
    """`hf-dp plan`: print the plan table (bad input: ValueError, one line from `main`)."""
    from . import mechanism_table
    from .user_counts import private_quantile

    if data.data is not None:  # the flags were checked by PlanDataArguments / PlanRunArguments
        exact = _read_examples_per_user(data.data, data.user_id_column)
        # Plan on public numbers: the number of users and a DP median, never an exact statistic of the data.
        median = private_quantile(exact, epsilon=data.data_epsilon)
        population = dict(users=len(exact), examples_per_user=median)
        source = (f"{data.data} (user column {data.user_id_column!r}), planned as {len(exact)} users x {median} "
                  f"examples: {median} is an ε-DP median of its examples per user (ε = {data.data_epsilon:g}, "
                  "exponential mechanism on a public grid); no exact count is shown")
    else:
        population = dict(users=data.users, examples_per_user=data.examples_per_user)
        source = f"{data.users} users x {data.examples_per_user} examples"
    rows = mechanism_table.compare(
        **population, examples_per_step=run.examples_per_step, steps=run.steps, target_epsilon=run.target_epsilon,
        target_delta=run.target_delta, noise_multiplier=run.noise_multiplier,
        contribution_bound=run.contribution_bound, adaptive_clipping=run.adaptive_clipping,
        clipping_count_noise=run.clipping_count_noise, trainable_parameters=run.trainable_parameters,
    )
    print(format_plan(rows, source=source, **population))
    return 0


def format_plan(rows: list[dict], *, users: int, examples_per_user: int, source: str) -> str:
    """The plan as an aligned text table with a header and notes (column names: the planner's keys)."""
    from .formatting import format_epsilon, format_number

    def _fmt(value, spec: str) -> str:
        return format_number(value, spec, missing="-")

    first = rows[0]
    lines = [
        f"Privacy budget plan: {source}",
        f"  {users} users, {users * examples_per_user} examples; examples per user: {examples_per_user}",
        f"  compute: {first['examples_per_step']:g} examples per step, {first['steps']} steps; "
        f"target ε = {first['target_epsilon']:g}",
        "",
    ]
    sigma_fixed = first["fixed_noise_multiplier"]
    header = ["mechanism", "privacy_unit", "G", "sample rate q", "expected_batch_size", "δ (+ sampler)",
              f"σ for ε={first['target_epsilon']:g}", "noise std"]
    if sigma_fixed is not None:
        header.append(f"ε at σ={sigma_fixed:g}")
    table = [header]
    for row in rows:
        cells = [row["label"], row["privacy_unit"], _fmt(row["contribution_bound"], "d"),
                 _fmt(row["sample_rate"], ".4g"), f"{row['expected_batch_size']:.4g} {row['sampled_unit']}",
                 f"{_fmt(row['delta'], '.2g')} + {_fmt(row['sampler_delta'], '.1g')}",
                 _fmt(row["noise_multiplier"], ".4g"), _fmt(row["noise_std"], ".3g")]
        if sigma_fixed is not None:
            cells.append(format_epsilon(row["epsilon_at_fixed_noise"], missing="-"))
        table.append(cells)
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for i, cells in enumerate(table):
        aligned = (c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(cells, widths)))
        lines.append("  ".join(aligned).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    lines.append("expected_batch_size: the DPTrainingArguments value that spends the same compute (users per step "
                 "for ULS, examples per step otherwise).")
    lines.append("noise std: σ / expected_batch_size, the std of the noise in the averaged update in units of the "
                 "clipping norm C (lower is better at equal compute).")
    lines.append("ε is prv-accountant's upper bound over both adjacency directions (add and remove).")
    lines.append("δ (+ sampler): the accountant's δ, plus what the noise sampler's finite support adds (its draws "
                 "reach 14.85σ), for --trainable_parameters values noised per step; DPTrainer states the sum.")
    if any(row.get("count_noise") is not None for row in rows):
        lines.append("adaptive clipping: σ (and a fixed --noise_multiplier) is the gradient noise multiplier DPTrainer "
                     "uses; the accountant composes it with the count's noise σ_b as σ_eff = (σ⁻² + (2σ_b)⁻²)^(-1/2).")
    for row in rows:
        if row["note"]:
            lines.append(f"{row['label']}: {row['note']}")
    return "\n".join(lines)
