"""The stats job's map and reduce tasks as Ray tasks (``--executor ray``).

The tasks are the local executor's functions (``count_shard``, ``run_range``) wrapped in
``ray.remote``: each map task reads its own shard of the input (the ``DataConfig`` travels, never
the data) and writes its runs under ``job.out/partials``; each reduce task writes one key
range's part. Both must see the same directory: on a cluster ``--work-dir`` is a shared mount,
or an object-store URL (store.py: tasks stage locally and publish whole objects with a marker).
A task whose worker dies is retried by Ray (``MAX_RETRIES``); a retried map task resumes
from the runs its dead attempt finished (``count_shard`` resumes), so nothing is counted twice.
Errors raised by our code inside a task (bad data, damaged partials) are not retried: they
would fail again; the driver re-raises them as they are.

``ray`` is imported when the executor is made, so the package and the CLI work without it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from pathlib import Path


from multitoken.base.progress import progress_bar
from multitoken.base.errors import MultitokenError, UsageError

from .merge import RangeTask, run_range
from .shard import Job, Shard
from .store import count_anywhere, is_remote, lock_dir, range_from_store

MAX_RETRIES = 3             # worker deaths per task before the job fails
LOCK_WAIT_SECONDS = 60.0    # an orphaned attempt of a killed driver may still hold a shard's lock
PROGRESS_SECONDS = 0.5      # how often tasks report tokens, and the driver redraws
INSTALL_HINT = 'pip install "multitoken[ray]"'


def import_ray():
    try:
        import ray
    except ImportError as err:
        raise UsageError(f"--executor ray needs Ray, which is not installed: {INSTALL_HINT}") from err
    return ray


class Progress:
    """A Ray actor holding each map task's latest token count (a retried attempt restarts from
    what its shard had finished, so the sum never counts a token twice)."""

    def __init__(self, n: int):
        self.tokens = [0] * n

    def set(self, slot: int, tokens: int) -> None:
        self.tokens[slot] = tokens

    def total(self) -> int:
        return sum(self.tokens)


def count_task(job: Job, shard: Shard, slot: int, progress) -> int:
    """Map task: count one shard; returns its tokens."""
    state = {"tokens": 0, "sent": 0.0}

    def report(n: int) -> None:
        state["tokens"] += n
        if time.monotonic() - state["sent"] > PROGRESS_SECONDS:
            progress.set.remote(slot, state["tokens"])
            state["sent"] = time.monotonic()

    tokens = _waiting_for_lock(lock_dir(job, shard), lambda: count_anywhere(job, shard, report))["tokens"]
    progress.set.remote(slot, tokens)
    return tokens


def _waiting_for_lock(sdir: Path, fn):
    """``fn()``, retried while another process holds the shard's lock: after a driver is killed,
    Ray kills its tasks' workers within seconds, and a rerun must not fail meanwhile."""
    deadline = time.monotonic() + LOCK_WAIT_SECONDS
    while True:
        try:
            return fn()
        except UsageError:
            if not _lock_held(sdir / ".lock") or time.monotonic() > deadline:
                raise  # another problem (e.g. partials of another job), or a live holder
            time.sleep(PROGRESS_SECONDS)


def _lock_held(path: Path) -> bool:
    """Whether a live process holds the flock on ``path`` (a file left by a killed one is not held)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def range_task(task: RangeTask) -> int:
    """Reduce task: merge one key range of every run into a pruned part."""
    return range_from_store(task) if is_remote(task.part) else run_range(task)


class RayExecutor:
    """Runs the tasks on the Ray cluster at ``address`` (None: the one ``RAY_ADDRESS`` names, or
    a new local one). A Ray already initialised in this process is used as it is and left running."""

    name = "ray"

    def __init__(self, address: str | None = None):
        self.ray = import_ray()
        self.owned = not self.ray.is_initialized()
        if self.owned:
            self.ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)

    def count(self, job: Job, shards: list[Shard]) -> int:
        ray = self.ray
        progress = ray.remote(num_cpus=0)(Progress).remote(len(shards))
        task = ray.remote(count_task).options(num_cpus=1, max_retries=MAX_RETRIES, name="stats-count")
        refs = [task.remote(job, s, i, progress) for i, s in enumerate(shards)]
        bar = progress_bar(desc="counting", unit="tok", unit_scale=True, dynamic_ncols=True, mininterval=PROGRESS_SECONDS)
        try:
            pending, done = list(refs), 0
            while pending:
                ready, pending = ray.wait(pending, num_returns=len(pending), timeout=PROGRESS_SECONDS)
                self._get(ready)  # a failed task stops the job now
                done += len(ready)
                bar.update(ray.get(progress.total.remote()) - bar.n)
                bar.set_postfix_str(f"shards {done}/{len(shards)}", refresh=False)
            return sum(self._get(refs))
        except BaseException:
            for ref in refs:
                ray.cancel(ref, force=True)
            raise
        finally:
            bar.close()
            ray.kill(progress)

    def map_ranges(self, tasks: list[RangeTask]) -> list[int]:
        task = self.ray.remote(range_task).options(num_cpus=1, max_retries=MAX_RETRIES, name="stats-merge")
        return self._get([task.remote(t) for t in tasks])

    def _get(self, refs: list) -> list:
        """``ray.get``, with our own errors raised as themselves (one line for the CLI), not
        wrapped in a RayTaskError that carries the remote traceback."""
        try:
            return self.ray.get(refs)
        except self.ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, MultitokenError):
                raise err.cause from None
            raise

    def close(self) -> None:
        if self.owned:
            self.ray.shutdown()
