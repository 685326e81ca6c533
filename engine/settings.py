"""Settings declared once: a frozen dataclass per layer, each field with its help and choices.

`strata serve`'s flags are generated from these dataclasses (server/settings.py for the HTTP
layer, engine/args.py for the engine, scheduler and KV store), and so is the README's flag
table (`python -m server.settings --write-readme`; tests/test_settings.py fails when it
drifts). A flag is `--` + the field name with dashes; its default is the field's default.
Plain Python: no torch (the server imports this).
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from pathlib import Path

FLAGS_BEGIN = "<!-- FLAGS_BEGIN: generated from the settings dataclasses; do not edit -->"
FLAGS_END = "<!-- FLAGS_END -->"


def setting(default, help: str, choices: tuple | None = None, group: str = "", **kw):
    """A dataclass field that is also a CLI flag (`help`, `choices`); `group` orders the
    README table."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices,
                                                        "group": group}, **kw)


def _base_type(cls, f: dataclasses.Field):
    """The flag's value type: the field's annotation without `| None`."""
    hint = typing.get_type_hints(cls)[f.name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def flags(cls) -> list[dataclasses.Field]:
    """The fields of `cls` that are flags (those declared with `setting`)."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def flag_name(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def add_flags(parser, cls, only: tuple[str, ...] | None = None) -> None:
    """One argparse option per setting of `cls` (or those named in `only`); unset options
    stay None (the field's default then applies), so the default lives in the dataclass."""
    for f in flags(cls):
        if only is not None and f.name not in only:
            continue
        typ = _base_type(cls, f)
        kw = dict(default=None, help=_help(f), dest=f.name)
        if typ is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = str if typ is Path else typ
            kw["choices"] = f.metadata["choices"]
        parser.add_argument(flag_name(f), **kw)


def _help(f: dataclasses.Field) -> str:
    shown = "none" if f.default is None else f.default
    return f"{f.metadata['help']} (default: {shown})"


def check_choices(obj) -> None:
    """ValueError naming the flag when a setting of `obj` is not one of its choices."""
    for f in flags(type(obj)):
        choices, value = f.metadata["choices"], getattr(obj, f.name)
        if choices and value not in choices:
            raise ValueError(f"{flag_name(f)} must be one of {', '.join(map(str, choices))}, "
                             f"got {value!r}")


def from_namespace(cls, ns: argparse.Namespace, **extra):
    """An instance of `cls` from parsed flags (None: the field's default) and `extra`."""
    values = {f.name: getattr(ns, f.name) for f in flags(cls)
              if getattr(ns, f.name, None) is not None}
    return cls(**values, **extra)


def markdown_rows(cls) -> list[str]:
    """The README table's rows for `cls`: flag, default, meaning (with the choices)."""
    rows = []
    order = {g: i for i, g in enumerate(dict.fromkeys(f.metadata["group"] for f in flags(cls)))}
    for f in sorted(flags(cls), key=lambda f: order[f.metadata["group"]]):
        default = "" if f.default is None else f"`{f.default}`"
        meaning = f.metadata["help"].replace("|", "\\|")
        if f.metadata["choices"]:
            meaning += " (" + " \\| ".join(f"`{c}`" for c in f.metadata["choices"]) + ")"
        rows.append(f"| `{flag_name(f)}` | {default} | {meaning} |")
    return rows
