"""A small JSON file of measured values kept across processes (a cache: losing it, or failing
to write it, only means measuring again)."""

from __future__ import annotations

import json
from pathlib import Path

from multitoken.base.atomic import atomic_write_text


def read_entries(path: Path) -> dict:
    """The entries kept in ``path``; {} when it is absent or unreadable."""
    try:
        kept = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return kept if isinstance(kept, dict) else {}


def keep_entry(path: Path, key: str, value) -> None:
    """Add or replace ``key`` in ``path`` (the whole file replaced atomically; a failed write is
    let go)."""
    kept = read_entries(path)
    kept[key] = value
    try:
        atomic_write_text(path, json.dumps(kept, indent=1, sort_keys=True) + "\n")
    except OSError:
        pass
