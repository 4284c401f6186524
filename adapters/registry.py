"""One registry of head types, by name. Each head module registers its config dataclass and
its ``nn.Module`` class once; names are unique (a second registration is an error, not an
override, so two plugins cannot silently shadow each other)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from multitoken.base.errors import CheckpointError, UsageError


@dataclass(frozen=True)
class HeadType:
    name: str
    config_cls: type  # a @dataclass with head_type and n_future fields
    module_cls: type  # nn.Module built as module_cls(config, backbone)


_REGISTRY: dict[str, HeadType] = {}
MAX_N_FUTURE = 16  # tokens per forward pass a heads config may predict


def register_head(name: str, config_cls: type, module_cls: type) -> HeadType:
    if name in _REGISTRY:
        raise ValueError(f"head type {name!r} is already registered (by {_REGISTRY[name].module_cls.__qualname__})")
    if not dataclasses.is_dataclass(config_cls):
        raise TypeError(f"{config_cls!r} must be a dataclass")
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    if "head_type" not in fields or "n_future" not in fields or fields["head_type"].default != name:
        raise TypeError(f"{config_cls.__name__} needs head_type (default {name!r}) and n_future fields")
    _REGISTRY[name] = HeadType(name, config_cls, module_cls)
    return _REGISTRY[name]


def registered_heads() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def get_head(name: str) -> HeadType:
    _load_builtin()
    if name not in _REGISTRY:
        raise UsageError(f"unknown head type {name!r}", f"use one of: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def make_config(head_type: str, **options):
    """A validated head config from a type name and options (unknown options are an error)."""
    cls = get_head(head_type).config_cls
    known = {f.name for f in dataclasses.fields(cls)} - {"head_type"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise UsageError(
            f"option(s) {', '.join(unknown)} do not apply to head type {head_type!r}",
            f"{head_type} takes: {', '.join(sorted(known))}",
        )
    return check_config(cls(head_type=head_type, **options))


def check_config(config):
    """``config`` if it can build heads (n_future, then the type's own ``validate``), else a
    UsageError: the one place head configs are validated (make_config, build_head)."""
    if not isinstance(config.n_future, int) or config.n_future < 1:  # every head type has one
        raise UsageError(f"n_future must be an integer >= 1, got {config.n_future!r}")
    if config.n_future > MAX_N_FUTURE:
        raise UsageError(
            f"--n {config.n_future}: heads predict at most {MAX_N_FUTURE} tokens per forward pass (each head adds "
            "an LM head's compute and memory to every step, drafts that long are almost never accepted in full, "
            "and dynamic decoding's k^n grid would not fit in memory)",
            f"pass --n between 2 and {MAX_N_FUTURE} (the papers use 2 to 5)")
    validate = getattr(config, "validate", None)
    if validate is not None:
        validate()
    return config


def config_from_dict(record: dict):
    """Inverse of ``dataclasses.asdict`` for a saved head config; errors name the problem."""
    if not isinstance(record, dict) or "head_type" not in record:
        raise CheckpointError("the head config has no head_type", "the heads_config.json file is malformed")
    options = {k: v for k, v in record.items() if k != "head_type"}
    try:
        return make_config(record["head_type"], **options)
    except UsageError as err:
        raise CheckpointError(f"cannot rebuild the saved head config: {err.problem}", err.fix) from err


def build_head(config, backbone):
    return get_head(config.head_type).module_cls(check_config(config), backbone)


BUILTIN = ("replicated", "whs", "cp", "medusa", "conditioned", "eagle3")


def _load_builtin() -> None:
    # Each built-in module registers itself on import. Imported by module name (not through the
    # package __init__), because editable installs load `multitoken.adapters` as a namespace.
    import importlib

    for name in BUILTIN:
        importlib.import_module(f"multitoken.adapters.{name}")
