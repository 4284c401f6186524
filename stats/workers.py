"""Run shard counting on local processes with one tqdm bar (tokens/s) for all of them."""

from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait


from multitoken.base.progress import progress_bar
from multitoken.base.cores import usable_cores

from .shard import Job, Shard, count_shard

_COUNTERS = None  # per-worker token counters shared with the parent (set in each worker)
PR_SET_PDEATHSIG = 1  # linux/prctl.h
PARENT_POLL_SECONDS = 1.0


def die_with_parent(parent_pid: int) -> None:
    """Pool initializer: this worker exits when the parent process dies (kill -9 included),
    instead of holding its memory forever. Linux: the kernel sends SIGKILL (prctl
    PR_SET_PDEATHSIG); elsewhere a daemon thread polls the parent's pid."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        armed = sys.platform.startswith("linux") and libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        armed = False
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)
    if not armed:
        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(PARENT_POLL_SECONDS)
            os._exit(1)

        threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def _init(counters, parent_pid: int) -> None:
    global _COUNTERS
    _COUNTERS = counters
    die_with_parent(parent_pid)


def _count_in_worker(job: Job, shard: Shard, slot: int, count) -> int:
    def progress(n: int) -> None:
        with _COUNTERS.get_lock():
            _COUNTERS[slot] += n

    return count(job, shard, progress)["tokens"]


def count_shards(job: Job, shards: list[Shard], num_proc: int, count=count_shard) -> int:
    """Count every shard (resuming finished work) with ``count`` (``count_shard`` or a wrapper
    of it, picklable); returns the tokens counted in total."""
    bar = progress_bar(desc="counting", unit="tok", unit_scale=True, dynamic_ncols=True, mininterval=0.5)
    try:
        if num_proc <= 1:
            return sum(count(job, s, bar.update)["tokens"] for s in shards)
        return _count_parallel(job, shards, num_proc, bar, count)
    finally:
        bar.close()


def _count_parallel(job: Job, shards, num_proc: int, bar, count) -> int:
    # spawn, not fork: the parent holds a loaded tokenizer (threads) and maybe torch
    ctx = mp.get_context("spawn")
    counters = ctx.Array("q", len(shards))
    with ProcessPoolExecutor(max_workers=min(num_proc, usable_cores()), mp_context=ctx, initializer=_init, initargs=(counters, os.getpid())) as pool:
        futures = [pool.submit(_count_in_worker, job, s, i, count) for i, s in enumerate(shards)]
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=0.5, return_when=FIRST_EXCEPTION)
            bar.update(sum(counters[:]) - bar.n)
            for f in done:
                if f.exception() is not None:
                    for p in pending:
                        p.cancel()
                    raise f.exception()
        return sum(f.result() for f in futures)
