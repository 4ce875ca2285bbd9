"""The `hf-dp` command (also `python -m hf_dp`).

Subcommands:

- `hf-dp demo`: the privacy/utility study on the embedded default (see `hf_dp.workflows.study`).
- `hf-dp app`: the Gradio app (see `hf_dp.workflows.app`); `hf-dp publish`: push a run with its privacy card.
- `hf-dp audit`: an empirical privacy audit, an ε lower bound beside the proven ε (see `hf_dp.workflows.audit_demo`).
- `hf-dp plan`: the privacy budget planner. For ULS, ELS (mixture-of-Gaussians accountant) and
  example-level DP-SGD at the same compute budget (`--examples_per_step`): the noise multiplier σ each
  needs for a target (ε, δ), the ε each spends at a fixed σ, the recommended contribution bound G, the
  sample rate, the `expected_batch_size` to train with (in its unit: users for ULS, examples otherwise)
  and the steps.

    hf-dp plan --users 1000 --examples_per_user 20 --examples_per_step 64 --steps 300 --target_epsilon 4
    hf-dp plan --data train.jsonl --user_id_column author --examples_per_step 256 --noise_multiplier 1.0

  With `--data`, the plan reads two numbers from the private file: the number of users and an ε-DP
  median of the examples per user (`--data_epsilon`, default 0.1); it prints no exact count statistic.

Flags are spelled like the `DPTrainingArguments` fields they stand for (`--target_epsilon`, `--target_delta`,
`--user_id_column`, `--noise_multiplier`, `--contribution_bound`); every flag also accepts dashes
(`--target-epsilon`). Bad input prints one line saying what to change on stderr and exits with status 2.

New subcommands: add a `_add_<name>(subparsers)` that registers the parser with
`set_defaults(func=_cmd_<name>)` and call it from `build_parser()`.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from collections import Counter

__all__ = ["build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump): `hf-dp plan: error: ...`, exit status 2."""

    def error(self, message: str):  # noqa: D401 - argparse API
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The `hf-dp` parser: one subparser per command, each with `func` set to its handler."""
    parser = _Parser(prog="hf-dp", description="User-level differentially private fine-tuning on the Hugging Face "
                                                "stack.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_plan(subparsers)
    for name in _MODULE_COMMANDS:
        _add_module_command(subparsers, name)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `hf-dp` with `argv` (default: the process arguments); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except (ValueError, OSError) as error:
        message = " ".join(str(error).split())  # one line
        print(f"{parser.prog} {args.command}: error: {message}", file=sys.stderr)
        return 2


# ---- hf-dp demo / app / publish (flags and behaviour: hf_dp.workflows.study / hf_dp.workflows.app / hf_dp.hub) ----

# name -> (module with build_parser/run, help, description)
_MODULE_COMMANDS = {
    "demo": ("workflows.study", "the privacy/utility study on the embedded default (MiniLM genres; --task causal_lm: "
             "SmolLM2 next-token)",
             "Public-only baseline, user-level DP (ULS) at ε=8 with adaptive clipping and non-private fine-tuning of "
             "the embedded MiniLM on Shakespeare speeches by role; --task causal_lm: the same for next-token "
             "prediction with the embedded SmolLM2-135M; --grid runs the full study."),
    "app": ("workflows.app", "Gradio app: budget planner, a short DP run, DP vs public-only baseline, privacy cards",
            "Serve the Gradio app on --host:--port over the runs in --results_dir."),
    "publish": ("hub", "upload a saved model, its tokenizer and its privacy card (README.md) to the Hub",
                "Upload a saved model, its tokenizer and its privacy card to the Hub; checks the card and that the "
                "Hub is reachable before uploading anything."),
    "audit": ("workflows.audit_demo", "empirical privacy audit: an ε lower bound from canary users beside the proven ε",
              "One-run privacy audit (Steinke, Nasr & Jagielski 2023) of the demo's ULS run on the embedded MiniLM: "
              "canary users added by fair coins, trained at --target_epsilon, scored; prints the ε lower bound beside "
              "the accountant's ε and writes --results_dir/audit.json."),
}


def _add_module_command(subparsers, name: str) -> None:
    import importlib

    module_name, help_text, description = _MODULE_COMMANDS[name]
    module = importlib.import_module(f".{module_name}", __package__)
    parser = subparsers.add_parser(name, help=help_text, description=description)
    module.build_parser(parser).set_defaults(func=module.run)


# ---- hf-dp plan -------------------------------------------------------------------------------

def _flag(group, name: str, **kwargs) -> None:
    """`--name_with_underscores` (the `DPTrainingArguments` spelling), also accepted as `--name-with-dashes`."""
    spellings = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
    group.add_argument(*spellings, dest=name, **kwargs)


def _add_plan(subparsers) -> None:
    plan = subparsers.add_parser(
        "plan",
        help="σ, ε, contribution bound G and expected_batch_size for ULS, ELS and example-level DP-SGD",
        description="Plan a DP fine-tuning run: for ULS, ELS (mixture-of-Gaussians accountant) and example-level "
                    "DP-SGD at the same compute budget, the noise multiplier σ each needs to meet (ε, δ), the ε "
                    "each spends at a fixed σ, the recommended contribution bound G, the sample rate, the "
                    "expected_batch_size to train with and the steps. Flags are DPTrainingArguments' field names "
                    "(dashes also accepted).",
    )
    population = plan.add_argument_group("data (either --users with --examples_per_user, or --data)")
    _flag(population, "users", type=int, help="number of users (at least 2)")
    _flag(population, "examples_per_user", type=int, help="examples (rows) of every user")
    _flag(population, "data", help="a .csv, .jsonl/.json or .parquet file with one example per row")
    _flag(population, "user_id_column", help="the column of --data holding the user id")
    _flag(population, "data_epsilon", type=float, default=0.1,
          help="ε of the DP median of --data's examples per user, the only statistic the plan reads from it "
               "besides the number of users (exponential mechanism on a public grid; spent by this plan, in no "
               "run's ledger). Default: 0.1")
    run = plan.add_argument_group("run")
    _flag(run, "examples_per_step", type=float, default=64.0,
          help="compute budget: expected examples processed per step, the same for every mechanism (ELS and "
               "example-level sample expected_batch_size = this many examples; ULS samples this many examples' "
               "worth of users). Default: 64")
    _flag(run, "steps", type=int, help="optimizer steps. Default: one expected pass over the examples")
    _flag(run, "target_epsilon", type=float, default=8.0, help="target ε. Default: 8")
    _flag(run, "target_delta", type=float,
          help="δ, below 1/users. Default: 1/(10·users) for the user-level rows and 1/(10·examples) for the "
               "example-level row (the defaults of DPTrainingArguments)")
    _flag(run, "noise_multiplier", type=float, help="also report the ε each mechanism spends at this fixed σ")
    _flag(run, "contribution_bound", type=int,
          help="G, the most examples kept per user, for ULS and ELS. Default: the median examples per user for "
               "ELS, the noise-prediction heuristic (Charles et al. 2024) for ULS")
    _flag(run, "adaptive_clipping", action="store_true",
          help="plan for private adaptive clipping (Andrew et al. 2021): σ is then the gradient noise multiplier "
               "DPTrainer calibrates, which leaves room for the noised count of unclipped units each step releases")
    _flag(run, "clipping_count_noise", type=float,
          help="σ_b, the noise std of adaptive clipping's count, in units. Default: expected_batch_size / 20, as "
               "DPTrainer (only with --adaptive_clipping)")
    plan.set_defaults(func=_cmd_plan)


def _read_examples_per_user(path: str, column: str) -> list[int]:
    """Rows per user in a data file (rows without a user id are ignored)."""
    import pandas as pd

    if not os.path.isfile(path):
        raise ValueError(f"--data {path!r}: no such file.")
    name = path.lower()
    readers = {".csv": pd.read_csv, ".tsv": lambda p: pd.read_csv(p, sep="\t"), ".parquet": pd.read_parquet,
               ".jsonl": lambda p: pd.read_json(p, lines=True), ".json": _read_json}
    suffix = next((s for s in readers if name.endswith(s)), None)
    if suffix is None:
        raise ValueError(f"--data {path!r}: use a .csv, .tsv, .jsonl, .json or .parquet file.")
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


def _read_json(path: str):
    import pandas as pd

    try:
        return pd.read_json(path)
    except ValueError:
        return pd.read_json(path, lines=True)


def _cmd_plan(args) -> int:
    from .accounting import planner

    if args.data is not None:
        if args.users is not None or args.examples_per_user is not None:
            raise ValueError("give either --data (with --user_id_column) or --users with --examples_per_user, "
                             "not both.")
        if not args.user_id_column:
            raise ValueError("--data needs --user_id_column (the column with the user id).")
        if not (args.data_epsilon > 0 and math.isfinite(args.data_epsilon)):
            raise ValueError(f"--data_epsilon {args.data_epsilon:g}: must be a positive number.")
        exact = _read_examples_per_user(args.data, args.user_id_column)
        # Plan on public numbers: the number of users and a DP median, never an exact statistic of the data.
        median = planner.private_quantile(exact, epsilon=args.data_epsilon)
        population = dict(users=len(exact), examples_per_user=median)
        source = (f"{args.data} (user column {args.user_id_column!r}), planned as {len(exact)} users x {median} "
                  f"examples: {median} is an ε-DP median of its examples per user (ε = {args.data_epsilon:g}, "
                  "exponential mechanism on a public grid); no exact count is shown")
    else:
        if args.users is None or args.examples_per_user is None:
            raise ValueError("give --users and --examples_per_user, or --data with --user_id_column.")
        if args.users < 2:
            raise ValueError(f"--users {args.users}: DPTrainer refuses training data with fewer than 2 users (a "
                             "user-level guarantee needs many users); give the number of users you will train on.")
        if args.examples_per_user < 1:
            raise ValueError(f"--examples_per_user {args.examples_per_user}: must be at least 1.")
        population = dict(users=args.users, examples_per_user=args.examples_per_user)
        source = f"{args.users} users x {args.examples_per_user} examples"
    for flag, value in (("--examples_per_step", args.examples_per_step), ("--target_epsilon", args.target_epsilon),
                        ("--noise_multiplier", args.noise_multiplier), ("--target_delta", args.target_delta),
                        ("--clipping_count_noise", args.clipping_count_noise)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{flag} {value:g}: must be a positive number.")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps {args.steps}: must be at least 1.")
    if args.contribution_bound is not None and args.contribution_bound < 1:
        raise ValueError(f"--contribution_bound {args.contribution_bound}: must be at least 1.")
    rows = planner.plan(
        **population, examples_per_step=args.examples_per_step, steps=args.steps, target_epsilon=args.target_epsilon,
        target_delta=args.target_delta, noise_multiplier=args.noise_multiplier,
        contribution_bound=args.contribution_bound, adaptive_clipping=args.adaptive_clipping,
        clipping_count_noise=args.clipping_count_noise,
    )
    print(format_plan(rows, source=source, **population))
    return 0


def format_plan(rows: list[dict], *, users: int, examples_per_user: int, source: str) -> str:
    """The plan as an aligned text table with a header and notes (column names: the planner's keys)."""
    from .formatting import format_number

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
    header = ["mechanism", "privacy_unit", "G", "sample rate q", "expected_batch_size", "δ",
              f"σ for ε={first['target_epsilon']:g}", "noise std"]
    if sigma_fixed is not None:
        header.append(f"ε at σ={sigma_fixed:g}")
    table = [header]
    for row in rows:
        cells = [row["label"], row["privacy_unit"], _fmt(row["contribution_bound"], "d"),
                 _fmt(row["sample_rate"], ".4g"), f"{row['expected_batch_size']:.4g} {row['sampled_unit']}",
                 _fmt(row["delta"], ".2g"), _fmt(row["noise_multiplier"], ".4g"), _fmt(row["noise_std"], ".3g")]
        if sigma_fixed is not None:
            cells.append(_fmt(row["epsilon_at_fixed_noise"], ".4g"))
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
    if any(row.get("count_noise") is not None for row in rows):
        lines.append("adaptive clipping: σ (and a fixed --noise_multiplier) is the gradient noise multiplier DPTrainer "
                     "uses; the accountant composes it with the count's noise σ_b as σ_eff = (σ⁻² + (2σ_b)⁻²)^(-1/2).")
    for row in rows:
        if row["note"]:
            lines.append(f"{row['label']}: {row['note']}")
    return "\n".join(lines)
