"""Where the stats job's tasks run: local processes (the default) or a Ray cluster.

Both executors run the same two kinds of task on the same code, so the stats dir is
byte-identical whichever runs them: a map task is ``shard.count_shard`` of one shard (the task
reads its own input and writes its runs under ``job.out/partials``), a reduce task is
``merge.run_range`` of one key range (it reads every run's slice and writes one part); with an
object-store work dir both go through store.py. The planning (which shards: sharding.py, which key
ranges) stays in the driver and does not depend on the executor.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from multitoken.base.errors import UsageError

from .merge import RangeTask, map_local
from .ray_executor import RayExecutor, import_ray
from .shard import Job, Shard
from .store import count_anywhere, is_remote, range_anywhere
from .workers import count_shards

EXECUTORS = ("local", "ray")


class Executor(Protocol):
    name: str

    def count(self, job: Job, shards: list[Shard]) -> int:
        """Count every shard (resuming finished work); returns the tokens counted in total."""

    def map_ranges(self, tasks: list[RangeTask]) -> list[int]:
        """Run ``run_range`` on every task; returns each part's entry count, in task order."""

    def close(self) -> None:
        """Release what the executor started (processes, a local Ray cluster)."""


@dataclass
class LocalExecutor:
    """Local processes: ``num_proc`` spawned workers (none for 1)."""

    num_proc: int
    name: str = "local"

    def count(self, job: Job, shards: list[Shard]) -> int:
        return count_shards(job, shards, self.num_proc, count_anywhere)

    def map_ranges(self, tasks: list[RangeTask]) -> list[int]:
        return map_local(range_anywhere, tasks, self.num_proc)

    def close(self) -> None:
        pass


def check_executor(name: str, address: str | None) -> None:
    """Fail before any work when the executor cannot run here (Ray not installed)."""
    if name not in EXECUTORS:
        raise UsageError(f"--executor {name!r} is not known", f"pass one of {', '.join(EXECUTORS)}")
    if name == "local" and address is not None:
        raise UsageError("--address is a Ray cluster's address", "pass --executor ray with it, or drop --address")
    if name == "ray":
        import_ray()


def make_executor(name: str, num_proc: int, address: str | None = None) -> Executor:
    check_executor(name, address)
    return RayExecutor(address) if name == "ray" else LocalExecutor(num_proc)


def work_path(url: str) -> Path | str:
    """The directory for partials and merge parts: a local path (a ``file://`` URL included), or
    the URL of an object store (any other fsspec protocol, e.g. ``s3://``), where tasks stage
    their output locally and publish it as whole objects with a ``_COMPLETE`` marker (store.py)."""
    if "://" not in url:
        return Path(url)
    if is_remote(url):
        return url.rstrip("/")
    import fsspec  # lazy: only a URL needs it, and fsspec is a dependency of datasets

    return Path(fsspec.core.url_to_fs(url)[1])
