"""Config values: numeric ranges as users write them (``0:1:0.1``), and the resolved configs a
command saves next to its outputs (``config.json``: what ran, with which settings and version)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from multitoken.base.atomic import atomic_write_text


MAX_RANGE_VALUES = 1001  # a start:stop:step option (e.g. --eps-b) gives at most this many values


def finite(token) -> float:
    """A finite number from ``token`` (nan and inf are never a sensible learning rate,
    temperature or threshold, and propagate silently): ValueError otherwise."""
    value = float(token)
    if not math.isfinite(value):
        raise ValueError(f"{token!r} is not a finite number")
    return value


def expand_range(token: str, cast=float) -> list:
    """``"0:1:0.25"`` -> ``[0, 0.25, 0.5, 0.75, 1]`` (stop included); ``"0.5"`` -> ``[0.5]``.

    Raises ValueError with a message that names the accepted syntax."""
    token = str(token).strip()
    if "," in token:
        raise ValueError(f"{token!r}: separate values by spaces (e.g. 0 0.5 1), or give a range start:stop:step")
    kind = "a whole number" if cast is int else "a number"
    if ":" not in token:
        try:
            return [finite(token) if cast is float else cast(token)]
        except ValueError:
            raise ValueError(f"{token!r} is not {kind}" + (" (nan and inf are refused)" if cast is float else "")) from None
    parts = token.split(":")
    try:
        start, stop, step = (finite(x) for x in parts)
    except ValueError:
        raise ValueError(f"{token!r}: a range is start:stop:step, three finite numbers, e.g. 0:1:0.1") from None
    if step <= 0 or stop < start:
        raise ValueError(f"{token!r}: a range needs step > 0 and stop >= start")
    count = int(round((stop - start) / step)) + 1  # counted before any value exists: a tiny step cannot hang
    if count > MAX_RANGE_VALUES:
        raise ValueError(f"{token!r} gives {count:,} values, more than {MAX_RANGE_VALUES:,}: each value is a whole run; "
                         f"use a step of at least {(stop - start) / (MAX_RANGE_VALUES - 1):.3g}")
    values = [round(start + i * step, 10) for i in range(count) if start + i * step <= stop + 1e-9]
    if cast is int:
        if any(v != int(v) for v in values):
            raise ValueError(f"{token!r}: this option takes whole numbers")
        return [int(v) for v in values]
    return [cast(v) for v in values]


def nested(cls, *, flags: tuple[str, ...] | None = None, help: dict | None = None, **defaults):
    """A config field holding another config (``cls``, built with ``defaults``): one source for
    its fields, their defaults and validation. The command line shows its fields as the outer
    command's own flags (``flags``: only these; ``help``: field name -> metadata that replaces
    the field's own, e.g. ``{"help": ...}``, where the command reads the value its own way)."""
    return dataclasses.field(default_factory=lambda: cls(**defaults),
                             metadata={"nested": {"flags": flags, "meta": help or {}}})


def config_dict(*configs) -> dict:
    """JSON-ready view of resolved dataclass configs, keyed by class name."""
    return {type(c).__name__: dataclasses.asdict(c) for c in configs}


def resolved_config_text(command: str, *configs, extra: dict | None = None) -> str:
    """The JSON text ``save_resolved_config`` writes: the resolved configs (+ ``extra`` facts,
    e.g. the data files read)."""
    from importlib.metadata import version

    record = {"command": command, "multitoken_version": version("multitoken"), **config_dict(*configs), **(extra or {})}
    return json.dumps(record, indent=2, default=str) + "\n"


def save_resolved_config(path: str | Path, command: str, *configs, extra: dict | None = None) -> None:
    atomic_write_text(path, resolved_config_text(command, *configs, extra=extra))
