"""Every hf_dp command line: dataclass fields parsed by `transformers.HfArgumentParser`.

A command's flags are the fields of a dataclass (help text in `metadata["help"]`, choices in
`metadata["choices"]`), as for [`~hf_dp.DPTrainingArguments`]: each is spelled as its field, `--target_epsilon`,
and also accepted with dashes, `--target-epsilon`. [`ArgumentParser`] is `HfArgumentParser` with what hf_dp's
commands (`hf-dp plan/demo/app/publish/audit`, `python -m hf_dp.hub`, `recipes/*.py`) also need:

- an optional number accepts `None`: `--target_epsilon None --noise_multiplier 1.0` runs in fixed-σ mode;
- `metadata={"positional": True}` makes a field a positional argument (`hf-dp publish RUN_DIR`);
- `one_line_errors=True`: bad input prints one line, `hf-dp plan: error: ...`, with exit status 2 (no usage dump);
- [`ArgumentParser.parse`]: the arguments as the parser's dataclasses (no `.args` file lookup, unknown flags are
  an argparse error like any other).

[`require_extra`] makes a command that needs an optional dependency fail with one line naming the extra to
install, and [`run_command`] is the `main` of every command: parse, run, and report such errors as one line.

[`check_numbers`] is the numeric check of an arguments dataclass, called from its `__post_init__` so that the
command line and a Python call refuse the same values: counts are whole numbers ≥ 1 (≥ 0 where 0 means something),
other numbers finite and positive, probabilities strictly between 0 and 1. A `ValueError` from a dataclass is a
parse error here: one line, `hf-dp audit: error: --max_steps 0: use a whole number >= 1 ...`, status 2, before
anything is loaded, trained or written.

```python
>>> from dataclasses import dataclass, field
>>> from hf_dp.command_line import ArgumentParser
>>> @dataclass
... class Flags:
...     target_epsilon: float | None = field(default=8.0, metadata={"help": "ε; None for a fixed σ."})
>>> ArgumentParser(Flags).parse(["--target-epsilon", "None"])
(Flags(target_epsilon=None),)
```
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import math
import numbers
import sys
import types
import typing
from typing import Callable, Mapping, Sequence

from transformers import HfArgumentParser

__all__ = ["ArgumentParser", "MissingExtraError", "check_numbers", "require_extra", "run_command"]


class MissingExtraError(ImportError):
    """A command needs an optional dependency that is not installed; the message names the extra to install."""


def require_extra(extra: str, *modules: str) -> None:
    """Raise [`MissingExtraError`] naming `pip install 'hf_dp[<extra>]'` unless every module in `modules` is
    installed (checked with `importlib.util.find_spec`, nothing is imported)."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingExtraError(f"needs {', '.join(missing)} (not installed): pip install 'hf_dp[{extra}]'")


def check_numbers(owner, rules: Mapping[str, str], *, flags: bool = True) -> None:
    """Refuse bad numbers in the fields of a dataclass instance `owner` (call it from `__post_init__`).

    Args:
        owner: the dataclass instance.
        rules (`Mapping[str, str]`): field name -> rule. `"int>=N"`: a whole number ≥ N (an integral float such as
            `8.0`, as a form or a config file gives, becomes the int; `True` is not a number); `"float>0"`: a
            finite number > 0; `"(0,1)"`: a number strictly between 0 and 1. `None` passes when the field is
            optional (`int | None`, or a `None` default).
        flags (`bool`, defaults to `True`): name a field as its flag (`--max_steps 0: ...`), else as a keyword
            (`max_steps=0: ...`).

    Raises:
        ValueError: one line naming each bad field, its value and what to give instead (`; ` between fields).
    """
    specs = {f.name: f for f in dataclasses.fields(owner)}
    problems = []
    for name, rule in rules.items():
        value = getattr(owner, name)
        spec = specs.get(name)
        optional = spec is not None and (spec.default is None or _allows_none(spec.type))
        if value is None and optional:
            continue
        ok, wanted = _check_rule(value, rule)
        if ok:
            if rule.startswith("int") and isinstance(value, float):
                setattr(owner, name, int(value))
            continue
        label = f"--{name} {value!r}" if flags else f"{name}={value!r}"
        unset = "" if not optional else ", or None for the default" if spec.default is None else ", or None"
        problems.append(f"{label}: use {wanted}{unset}")
    if problems:
        raise ValueError("; ".join(problems) + ".")


def _allows_none(annotation) -> bool:
    """Whether a field's annotation (a string under `from __future__ import annotations`) admits `None`."""
    if isinstance(annotation, str):
        return "None" in annotation or "Optional" in annotation
    return type(None) in typing.get_args(annotation)


def _check_rule(value, rule: str) -> tuple[bool, str]:
    """(whether `value` follows `rule`, what the rule asks for in words)."""
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    finite = real and math.isfinite(value)
    if rule.startswith("int>="):
        least = int(rule[len("int>="):])
        whole = finite and (isinstance(value, numbers.Integral) or float(value).is_integer())
        return whole and value >= least, f"a whole number >= {least}"
    if rule == "float>0":
        return finite and value > 0, "a finite number > 0"
    if rule == "(0,1)":
        return finite and 0 < value < 1, "a number strictly between 0 and 1"
    raise ValueError(f"unknown rule {rule!r}: use 'int>=N', 'float>0' or '(0,1)'.")


def _optional_number(annotation) -> type | None:
    """`int` or `float` for an `int | None` / `float | None` annotation, else None."""
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return None
    args = set(typing.get_args(annotation))
    if type(None) not in args or len(args) != 2:
        return None
    (kind,) = args - {type(None)}
    return kind if kind in (int, float) else None


def _none_or(kind: type) -> Callable[[str], object]:
    def convert(text: str):
        return None if text == "None" else kind(text)

    convert.__name__ = kind.__name__  # argparse says "invalid float value: 'x'"
    return convert


class ArgumentParser(HfArgumentParser):
    """`HfArgumentParser` with `None` for optional numbers, positional fields and, optionally, one-line errors.

    Args:
        dataclass_types: the dataclass (or dataclasses) whose fields are the flags.
        one_line_errors (`bool`, defaults to `False`): print `prog: error: message` and exit with status 2 on bad
            input, without the usage text.
        **kwargs: passed to `argparse.ArgumentParser` (`prog`, `description`, `formatter_class`, ...).
    """

    def __init__(self, dataclass_types=None, *, one_line_errors: bool = False, **kwargs):
        self.one_line_errors = one_line_errors
        super().__init__(dataclass_types, **kwargs)

    def error(self, message: str):  # noqa: D401 - argparse API
        if not self.one_line_errors:
            super().error(message)
        self.exit(2, f"{self.prog}: error: {message}\n")

    @staticmethod
    def _parse_dataclass_field(parser, field: dataclasses.Field):
        metadata = dict(field.metadata)
        if metadata.pop("positional", False):
            if field.default is not dataclasses.MISSING:
                metadata.update(nargs="?", default=field.default)
            parser.add_argument(field.name, **metadata)
            return
        kind = _optional_number(field.type)
        if kind is not None:
            field = copy.copy(field)  # HfArgumentParser rewrites field.type: leave the dataclass's own field alone
            field.type = _none_or(kind)
        HfArgumentParser._parse_dataclass_field(parser, field)

    def parse(self, args: Sequence[str] | None = None) -> tuple:
        """`args` (default: the process arguments) as one instance of each of the parser's dataclasses."""
        return self.dataclasses_from(self.parse_args(args))

    def dataclasses_from(self, namespace: argparse.Namespace) -> tuple:
        """The parser's dataclasses built from a parsed namespace (which may hold other keys too).

        A `ValueError` from a dataclass's `__post_init__` (a bad value, [`check_numbers`]) is a parse error:
        `prog: error: message`, status 2.
        """
        built = []
        for dtype in self.dataclass_types:
            try:
                built.append(dtype(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(dtype) if f.init}))
            except ValueError as error:
                self.error(str(error))
        return tuple(built)


def run_command(parser: ArgumentParser, run: Callable[..., int | None], argv: Sequence[str] | None = None,
                name: str | None = None) -> int:
    """Parse `argv` with `parser`, call `run` with its dataclasses and return the exit status.

    A missing extra, or a `ValueError` / `OSError` from the command, prints one line on stderr,
    `<name>: error: ...`, and returns 2 (argparse already exits with 2 on a bad flag).
    """
    arguments = parser.parse(argv)
    try:
        return run(*arguments) or 0
    except (MissingExtraError, ValueError, OSError) as error:
        message = " ".join(str(error).split())  # one line
        print(f"{name or parser.prog}: error: {message}", file=sys.stderr)
        return 2
