"""Settings written once: dataclass fields from which the command line is generated.

Each program's settings are one dataclass (`teacher_server.config.ServerConfig`,
`teacher_server.admin.AdminConfig`, `student_trainer.config.TrainConfig`,
`distill_demo.config.DemoConfig`). A field is a setting: its default, its help text
(``metadata={"help": ...}``) and, as a ``Literal`` type, its choices. The dataclass
checks its values once, in ``__post_init__``, and raises `ConfigError` naming the flag
to change, so a setting made in Python is checked the same way as one typed as a flag.

`transformers.HfArgumentParser` turns the fields into flags: ``max_batch_tokens``
becomes ``--max-batch-tokens`` (``--max_batch_tokens`` is accepted too), a bool a switch,
a ``Literal`` a set of choices. The field's type parses the flag's text, so a type such
as `ByteCount` reads ``8GiB``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import typing
from typing import Literal

_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
# --log-level's values (either case).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class ConfigError(ValueError):
    """A setting has a value the program cannot use; the message names the flag to change."""


def flag(name: str) -> str:
    """The flag of a settings field: max_batch_tokens -> --max-batch-tokens."""
    return "--" + name.replace("_", "-")


class ByteCount(int):
    """A byte count; as a flag's text also with a unit: 123, 512MiB, 8GiB, 2GB (binary and decimal)."""

    def __new__(cls, value: int | str = 0) -> "ByteCount":
        if not isinstance(value, str):
            return super().__new__(cls, value)
        number = value.strip().lower()
        stripped = number.rstrip("kmgtib")
        digits, unit = stripped.strip(), number[len(stripped):]
        try:
            return super().__new__(cls, int(float(digits) * _BYTE_UNITS[unit]))
        except (KeyError, ValueError) as e:
            # argparse shows an ArgumentTypeError's own message (and only a generic one for others).
            raise argparse.ArgumentTypeError(f"{value!r} is not a byte count: use e.g. 1073741824, 512MiB, "
                                             "8GiB") from e


class IntTuple(tuple):
    """Integers; as a flag's text separated by commas: 0,1,2 (empty: none)."""

    def __new__(cls, value: typing.Iterable[int] | str = ()) -> "IntTuple":
        if not isinstance(value, str):
            return super().__new__(cls, (int(x) for x in value))
        try:
            return super().__new__(cls, (int(x) for x in value.split(",") if x.strip()))
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{value!r}: use integers separated by commas, e.g. 0,1") from e


class Repeated(str):
    """A flag given once per value (``--teacher-spec A --teacher-spec B``): the field holds the
    list of them. Declare it with `repeated`."""


def repeated(help_text: str, metavar: str):
    """The field arguments of a `Repeated` setting: a list, empty by default, one item per flag."""
    return dataclasses.field(default_factory=list, metadata={"help": help_text, "action": "append",
                                                              "metavar": metavar})


def check_choices(settings) -> None:
    """Raises ConfigError for a ``Literal`` field whose value is not one of its choices."""
    hints = typing.get_type_hints(type(settings))
    for field in dataclasses.fields(settings):
        hint = hints[field.name]
        value = getattr(settings, field.name)
        if typing.get_origin(hint) is Literal and value not in typing.get_args(hint):
            choices = ", ".join(repr(c) if c == "" else str(c) for c in typing.get_args(hint))
            raise ConfigError(f"{flag(field.name)} {value!r}: use one of {choices}")


def non_defaults(settings) -> dict:
    """The settings that differ from their defaults, for the start-up log.

    A field with ``repr=False`` is a secret: shown as "(set)" when it has a value.
    """
    changed = {}
    for field in dataclasses.fields(settings):
        if not field.init:  # derived from the others
            continue
        value = getattr(settings, field.name)
        if not field.repr:
            if value:
                changed[field.name] = "(set)"
            continue
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            default = dataclasses.MISSING  # required: always given, always shown
        if value != default:
            changed[field.name] = value
    return changed


class HelpFormatter(argparse.HelpFormatter):
    """--help as people read it: one spelling per flag, switches without a value, and a
    default only where it says something (not for an empty one, nor where the help text
    explains its default itself)."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        shown = copy.copy(action)
        shown.option_strings = [o for o in action.option_strings if "_" not in o] or action.option_strings
        if action.nargs == "?" and action.const is True:  # HfArgumentParser's bool: --flag, or --flag false
            shown.nargs = 0
        return super()._format_action_invocation(shown)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or default is None or default is False or default is argparse.SUPPRESS
                or (isinstance(default, (str, tuple, list)) and not default) or "default" in text):
            return text
        return f"{text} (default: %(default)s)"


def settings_parser(settings: type, **kwargs) -> argparse.ArgumentParser:
    """The command line of a settings dataclass (kwargs: argparse.ArgumentParser's)."""
    from transformers import HfArgumentParser  # about a second to import: only where flags are parsed

    return HfArgumentParser(settings, **parser_options(**kwargs))


def parser_options(**kwargs) -> dict:
    """What every settings parser is built with; for a subcommand's parser too."""
    return {"formatter_class": HelpFormatter, "usage": "%(prog)s [options]", **kwargs}


def settings_from(settings: type, args: argparse.Namespace):
    """The settings dataclass from parsed flags (its checks run: ConfigError)."""
    return settings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(settings) if f.init})
