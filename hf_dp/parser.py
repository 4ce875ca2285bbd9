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

```python
>>> from dataclasses import dataclass, field
>>> from hf_dp.parser import ArgumentParser
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
import sys
import types
import typing
from typing import Callable, Sequence

from transformers import HfArgumentParser

__all__ = ["ArgumentParser", "MissingExtraError", "require_extra", "run_command"]


class MissingExtraError(ImportError):
    """A command needs an optional dependency that is not installed; the message names the extra to install."""


def require_extra(extra: str, *modules: str) -> None:
    """Raise [`MissingExtraError`] naming `pip install 'hf_dp[<extra>]'` unless every module in `modules` is
    installed (checked with `importlib.util.find_spec`, nothing is imported)."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingExtraError(f"needs {', '.join(missing)} (not installed): pip install 'hf_dp[{extra}]'")


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
        """The parser's dataclasses built from a parsed namespace (which may hold other keys too)."""
        return tuple(
            dtype(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(dtype) if f.init})
            for dtype in self.dataclass_types
        )


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
