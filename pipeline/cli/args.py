"""Dataclass configs drive the CLI: each field becomes a ``--flag`` and back.

Field metadata may carry ``help``, ``choices``, ``flag`` (another flag name), ``positional``,
``default_help`` (how the default reads in --help, e.g. ``0:1:0.1``) and ``cli_default`` (the
command line's default where it differs from the library's, e.g. ``--threads``). ``bool`` fields
become ``--name/--no-name`` switches. Tuple fields take space-separated values; numeric ones
also take ``start:stop:step`` ranges as one token (stop included): ``--eps-b 0 0.5 1`` or
``--eps-b 0:1:0.1``. Each config class is shown under a plain-words title (``TITLES``). A field
made by ``config_io.nested`` holds another config (sweep's ``DecodeConfig``, ``DecodeConfig``'s
groups): its fields become flags of the same names, under that config's title. The resolved dataclass is what commands
save next to their outputs (a nested config as a nested object).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from multitoken.base.config_io import expand_range, finite


# --help group title of each config class (class name -> plain words)
TITLES = {
    "GenerateConfig": "prompt and output",
    "DecodeConfig": "decoding",
    "Sampling": "sampling",
    "DynamoOptions": "DynaMo (--mode dynamic; joint drafts)",
    "Speculation": "speculation (--mode speculative / typical)",
    "TreeOptions": "trees (--mode speculative / typical)",
    "BackboneConfig": "base model",
    "AttachConfig": "heads to create",
    "ConvertLlama2cConfig": "checkpoint to convert",
    "ExportConfig": "export",
    "ImportConfig": "checkpoint to import",
    "TrainConfig": "training",
    "DataConfig": "data",
    "DistillConfig": "sampling the corpus",
    "RecipeConfig": "the recipe",
    "EvalConfig": "evaluation",
    "SweepConfig": "sweep",
    "BuildConfig": "counting",
    "MergeConfig": "merging",
    "InfoConfig": "stats dir",
}


def title(cls) -> str:
    """The plain-words --help title of a config class."""
    name = cls.__name__
    return TITLES.get(name) or name.removesuffix("Config").lower() or "options"


def _base_type(tp):
    """``int | None`` -> ``int``; ``tuple[str, ...]`` -> ``(str, '+')``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    if origin in (tuple, list):
        return typing.get_args(tp)[0], "+"
    return tp, None


def finite_arg(token: str) -> float:
    """argparse ``type`` of a float option (``finite``, with its own message)."""
    try:
        return finite(token)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{token!r} is not a finite number (nan and inf are refused)") from None


def _list_item(cast):
    """argparse ``type`` of one token of a numeric list option: a value or a range (a list)."""
    def parse(token: str) -> list:
        try:
            return expand_range(token, cast)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from err

    parse.__name__ = cast.__name__  # argparse names the type in its messages
    return parse


def plain(value) -> str:
    """A default as a user writes it: ``0 0.5 1`` for tuples, on/off for switches."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (tuple, list)):
        return " ".join(plain(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _help(meta, default) -> str:
    help_ = meta.get("help", "")
    if "(default" in help_ or meta.get("positional") or default is argparse.SUPPRESS:
        return help_
    shown = meta.get("default_help")
    if shown is None and default not in (None, "", ()):
        shown = plain(default)
    return f"{help_} (default: {shown})".strip() if shown is not None else help_


def _field_default(f, instance=None):
    """A field's default: read from ``instance`` (a nested config's defaults), else the field's."""
    if instance is not None:
        return getattr(instance, f.name)
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def _flag_fields(cls, exclude=(), only=None, meta=None, instance=None):
    """``(field, metadata, default)`` of each field of ``cls`` the command line shows; a nested
    config's fields (``config_io.nested``) come flattened, after the outer ones."""
    out, inner = [], []
    for f in dataclasses.fields(cls):
        if f.name in exclude or not f.init:
            continue
        if "nested" in f.metadata:  # its own fields are filtered by ``only`` where it is added
            inner.append(f)
            continue
        if only is not None and f.name not in only:
            continue
        out.append((f, {**f.metadata, **(meta or {}).get(f.name, {})}, _field_default(f, instance)))
    return out, inner


def add_dataclass_args(parser: argparse.ArgumentParser, cls, prefix: str = "", exclude: tuple[str, ...] = (), *,
                       only: tuple[str, ...] | None = None, meta: dict | None = None, instance=None):
    """One flag per field of ``cls`` (under its plain-words title); a nested config field adds
    its own group. ``only``/``meta``/``instance``: a nested config's flag subset, help and
    defaults."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(title(cls))
    fields, inner = _flag_fields(cls, exclude, only, meta, instance)
    for f, meta_, default in fields:
        add_flag(group, f.name, hints[f.name], meta_, meta_.get("cli_default", default), prefix=prefix)
    for f in inner:
        sub = _field_default(f, instance)
        spec = f.metadata["nested"]  # a group without its own flag subset takes the outer one
        add_dataclass_args(parser, type(sub), prefix, only=spec["flags"] if spec["flags"] is not None else only,
                           meta={**(meta or {}), **spec["meta"]}, instance=sub)


def add_flag(group, name: str, hint, meta, default, *, prefix: str = "", dest: str | None = None) -> None:
    """The flag of one config field ``name`` (type ``hint``, field ``meta``data); ``default``
    ``argparse.SUPPRESS`` leaves it out of the namespace unless given."""
    tp, nargs = _base_type(hint)
    help_ = _help(meta, default)
    dest = dest or prefix + name
    if meta.get("positional"):
        optional = {"default": default} if meta.get("nargs") == "?" else {}  # argparse's own default is None
        group.add_argument(dest, type=tp, help=help_, nargs=meta.get("nargs"), **optional)
        return
    flag = meta.get("flag", "--" + (prefix + name).replace("_", "-"))
    if tp is bool:
        group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=default, help=help_)
        return
    if nargs and tp in (int, float):
        tp = _list_item(tp)
    elif tp is float:
        tp = finite_arg
    group.add_argument(flag, dest=dest, type=tp, default=default, help=help_,
                       choices=meta.get("choices"), nargs=nargs, metavar=meta.get("metavar"))


def set_default(parser: argparse.ArgumentParser, dest: str, value, meta: dict | None = None) -> None:
    """Another default for one flag of one command; its help is rebuilt from ``meta`` (field
    metadata: help, default_help) or keeps its text with the new default."""
    parser.set_defaults(**{dest: value})
    for action in parser._actions:  # argparse has no public lookup of an action by dest
        if action.dest == dest:
            meta = meta or {"help": (action.help or "").split(" (default: ")[0]}
            action.help = _help(meta, value)


def _flatten(values: list) -> tuple:
    out = []
    for v in values:
        out.extend(v if isinstance(v, list) else [v])
    return tuple(out)


def dataclass_from_args(cls, ns: argparse.Namespace, prefix: str = "", *, only=None, instance=None, **overrides):
    """``cls`` from the parsed flags (a nested config field from its flattened flags; fields
    without a flag keep ``instance``'s value or their default)."""
    values = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if "nested" in f.metadata:
            sub = _field_default(f, instance)
            flags = f.metadata["nested"]["flags"]
            values[f.name] = dataclass_from_args(type(sub), ns, prefix, only=flags if flags is not None else only, instance=sub)
            continue
        key = prefix + f.name
        if hasattr(ns, key) and (only is None or f.name in only):
            v = getattr(ns, key)
            values[f.name] = _flatten(v) if isinstance(v, list) else v
        elif instance is not None:
            values[f.name] = getattr(instance, f.name)
    values.update(overrides)
    return cls(**values)
