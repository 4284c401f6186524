"""The cores this process may use, and counts of threads or processes bounded by them (no
torch here: the stats job's driver and workers import it)."""

from __future__ import annotations

import os
import sys


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # macOS and Windows have no affinity call
        return os.cpu_count() or 1


def bounded_by_cores(count: int, flag: str, what: str, cores: int | None = None) -> int:
    """``count`` (threads or processes ``flag`` asks for), at most the usable cores; past them,
    one warning line on stderr says so (``what``: what the count is, e.g. "worker processes").
    More than one per core only wait on each other, and each one more slows every step."""
    cores = cores or usable_cores()
    if count <= cores:
        return count
    print(f"warning: {flag} {count} is more than the {cores} cores this process may use: using {cores} {what}",
          file=sys.stderr)
    return cores
