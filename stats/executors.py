"""Where the stats job's tasks run: local processes (the default) or a Ray cluster.

Both executors run the same two kinds of task on the same code, so the stats dir is
byte-identical whichever runs them: a map task is ``shard.count_shard`` of one shard (the task
reads its own input and writes its runs under ``job.out/partials``), a reduce task is
``merge.run_range`` of one key range (it reads every run's slice and writes one part). The
planning (which shards, which key ranges) stays in the driver and does not depend on the executor.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from multitoken.pipeline.base.errors import UsageError

from .merge import RangeTask, map_local, run_range
from .ray_executor import RayExecutor, import_ray
from .shard import Job, Shard
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
        return count_shards(job, shards, self.num_proc)

    def map_ranges(self, tasks: list[RangeTask]) -> list[int]:
        return map_local(run_range, tasks, self.num_proc)

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


def work_path(url: str) -> Path:
    """The directory for partials and merge parts, from a local path or an fsspec URL.

    Workers write there with POSIX renames (the atomic writes of pipeline/base/atomic.py) and
    read it memory-mapped, so it must be a file system every node mounts: a local path (one
    machine) or a shared mount (NFS, Lustre, EFS, a FUSE-mounted bucket), given as a path or a
    ``file://`` URL. Object stores (``s3://``, ``gs://``) have no rename, so they are refused
    with the mount as the fix.
    """
    import fsspec  # lazy: only a URL needs it, and fsspec is a dependency of datasets

    if "://" not in url:
        return Path(url)
    fs, path = fsspec.core.url_to_fs(url)
    if not isinstance(fs, fsspec.implementations.local.LocalFileSystem):
        raise UsageError(f"--work-dir {url}: partials need a file system every worker mounts (with atomic renames), "
                         f"not {fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]}://",
                         "mount the bucket on every node (e.g. s3fs, gcsfuse, EFS) and pass the mount path")
    return Path(path)
