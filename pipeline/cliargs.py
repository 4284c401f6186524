"""Dataclass configs drive the CLI: each field becomes a ``--flag`` and back.

Field metadata may carry ``help``, ``choices``, ``flag`` (another flag name) and ``positional``.
``bool`` fields become ``--name/--no-name`` switches. The resolved dataclass is what commands
save next to their outputs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from pathlib import Path

from .atomic import atomic_write_text


def _base_type(tp):
    """``int | None`` -> ``int``; ``tuple[str, ...]`` -> ``(str, '+')``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    if origin in (tuple, list):
        return typing.get_args(tp)[0], "+"
    return tp, None


def add_dataclass_args(parser: argparse.ArgumentParser, cls, prefix: str = "", exclude: tuple[str, ...] = ()):
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if f.name in exclude or not f.init:
            continue
        meta = f.metadata
        tp, nargs = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        help_ = meta.get("help", "")
        if default is not None and "default" not in help_:
            help_ = f"{help_} (default: {default})".strip()
        dest = prefix + f.name
        if meta.get("positional"):
            group.add_argument(dest, type=tp, help=help_, nargs=meta.get("nargs"))
            continue
        flag = meta.get("flag", "--" + (prefix + f.name).replace("_", "-"))
        if tp is bool:
            group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=default, help=help_)
        else:
            group.add_argument(flag, dest=dest, type=tp, default=default, help=help_,
                               choices=meta.get("choices"), nargs=nargs, metavar=meta.get("metavar"))


def dataclass_from_args(cls, ns: argparse.Namespace, prefix: str = "", **overrides):
    values = {}
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if f.init and hasattr(ns, key):
            v = getattr(ns, key)
            values[f.name] = tuple(v) if isinstance(v, list) else v
    values.update(overrides)
    return cls(**values)


def config_dict(*configs) -> dict:
    """JSON-ready view of resolved dataclass configs, keyed by class name."""
    return {type(c).__name__: dataclasses.asdict(c) for c in configs}


def resolved_config_text(command: str, *configs) -> str:
    """The JSON text ``save_resolved_config`` writes."""
    from importlib.metadata import version

    record = {"command": command, "multitoken_version": version("multitoken"), **config_dict(*configs)}
    return json.dumps(record, indent=2, default=str) + "\n"


def save_resolved_config(path: str | Path, command: str, *configs) -> None:
    atomic_write_text(path, resolved_config_text(command, *configs))
