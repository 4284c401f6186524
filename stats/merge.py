"""Reduce step: merge the runs of all shards by key range, prune, write the stats dir.

Each order's key space is cut into ranges holding about equally many run entries (cut points
are quantiles of a sample of run keys). A range task reads its slice of every run (runs are
sorted, so a slice is two binary searches into a memory-mapped file), merges, prunes by the
order's minimum count and writes one part; tasks are independent, so they run in parallel
and a rerun skips finished parts. Parts are then concatenated in key order.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from multitoken.base.cores import usable_cores

from .counting import merge_runs
from .format import load_array, read_info, write_array_dir
from .workers import die_with_parent

MERGE_BYTES_PER_ENTRY = 64   # concatenation + argsort order + sorted copies + output, per entry
SAMPLE_PER_RANGE = 64        # sampled keys per range when choosing cut points


@dataclass(frozen=True)
class RangeTask:
    order: int
    index: int
    lo: int          # keys in [lo, hi)
    hi: int
    runs: tuple[str, ...]
    min_count: int
    part: str        # output array dir


def sum_unigrams(runs: list[Path], vocab_size: int) -> np.ndarray:
    total = np.zeros(vocab_size, np.uint64)
    for run in runs:
        total += load_array(run, "o1", read_info(run))
    return total


def range_tasks(runs: list[Path], order: int, memory_bytes: int, min_ranges: int, work: Path | str, min_count: int,
                names: dict[str, str] | None = None) -> list[RangeTask]:
    """Range tasks for one order, sized so one task fits in ``memory_bytes``. ``names``: the run
    paths the tasks read instead of the local ones (URLs of an object-store work dir)."""
    keys = [load_array(r, f"k{order}", read_info(r)) for r in runs]
    entries = sum(k.size for k in keys)
    n_ranges = max(min_ranges, math.ceil(entries * MERGE_BYTES_PER_ENTRY / max(memory_bytes, 1)), 1)
    n_ranges = min(n_ranges, max(entries, 1))
    step = max(1, entries // (n_ranges * SAMPLE_PER_RANGE))
    sample = np.sort(np.concatenate([k[::step] for k in keys] + [np.zeros(0, np.uint64)]))
    cuts = [int(sample[(i * sample.size) // n_ranges]) for i in range(1, n_ranges)] if sample.size else []
    bounds = [0] + sorted(set(c for c in cuts if c > 0)) + [2**64 - 1]
    return [
        RangeTask(order, i, bounds[i], bounds[i + 1], tuple((names or {}).get(str(r), str(r)) for r in runs), min_count,
                  f"{str(work).rstrip('/')}/o{order}-part-{i:05d}-of-{len(bounds) - 1:05d}")
        for i in range(len(bounds) - 1)
    ]


def run_range(task: RangeTask) -> int:
    """Merge one key range of all runs into a pruned part; returns its entry count."""
    part = Path(task.part)
    if part.exists():  # finished before an interruption (and planned the same way)
        info = read_info(part)
        if info.get("range") == [task.lo, task.hi]:
            return info["arrays"]["keys"][0]
    slices = []
    for run in map(Path, task.runs):
        info = read_info(run)
        keys = load_array(run, f"k{task.order}", info)
        counts = load_array(run, f"c{task.order}", info)
        starts = np.array(load_array(run, f"s{task.order}", info))
        bounds = np.array([task.lo, task.hi], dtype=np.uint64)
        for a, b in zip(starts[:-1].tolist(), starts[1:].tolist()):  # each sorted sub-run
            lo, hi = a + np.searchsorted(keys[a:b], bounds)
            if hi > lo:
                slices.append((np.array(keys[lo:hi]), np.array(counts[lo:hi])))
    keys, counts = merge_runs(slices)  # empties `slices`
    keep = counts >= task.min_count
    keys, counts = keys[keep], counts[keep]
    write_array_dir(part, {"keys": keys, "counts": counts}, {"order": task.order, "range": [task.lo, task.hi]})
    return int(keys.size)


def assemble(parts: list[Path], out: Path, order: int) -> tuple[int, str]:
    """Concatenate parts (in key order) into ``keysN.npy`` / ``countsN.npy``; returns (length, count dtype)."""
    infos = [read_info(p) for p in parts]
    length = sum(i["arrays"]["keys"][0] for i in infos)
    top = max((int(load_array(p, "counts", i).max(initial=0)) for p, i in zip(parts, infos)), default=0)
    count_dtype = np.uint32 if top < 2**32 else np.uint64  # halves the table for all but huge corpora
    for name, dtype in (("keys", np.uint64), ("counts", count_dtype)):
        final = out / f"{name}{order}.npy"
        tmp = out / f".{name}{order}.npy.tmp-{os.getpid()}"
        arr = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(length,))
        pos = 0
        for p, i in zip(parts, infos):
            src = load_array(p, name, i)
            arr[pos:pos + src.size] = src
            pos += src.size
        arr.flush()
        del arr
        os.replace(tmp, final)
    return length, np.dtype(count_dtype).name


def merge_orders(
    runs: list[Path], out: Path, order: int, min_counts: list[int], vocab_size: int,
    memory_bytes: int, num_proc: int, progress: Callable[[str], None] | None = None, work: Path | None = None,
    map_ranges: Callable[[list[RangeTask]], list[int]] | None = None,
    names: dict[str, str] | None = None, fetch_parts: Callable[[list[str], Path], list[Path]] | None = None,
) -> dict:
    """Write ``counts1.npy`` and ``keysN/countsN.npy`` for N = 2..order into ``out`` (a staging
    dir: temp files of a killed assembly stay there, never in a finished stats dir). Merged
    key ranges go to ``work`` (default ``out/merge-parts``), where a rerun finds them.

    ``num_proc`` sets the least number of key ranges per order; ``map_ranges`` runs the range
    tasks (default: on ``num_proc`` local processes; see executors.py). Returns per order the
    distinct n-grams kept and the count dtype.

    An object-store work dir (store.py): ``work`` is its URL, ``names`` maps local run dirs to
    their URLs, and ``fetch_parts(parts, dest)`` brings the written parts here to assemble.
    """
    work = work if work is not None else out / "merge-parts"
    if fetch_parts is None:
        Path(work).mkdir(parents=True, exist_ok=True)
    uni = sum_unigrams(runs, vocab_size)
    uni[uni < min_counts[0]] = 0
    tmp = out / f".counts1.npy.tmp-{os.getpid()}"
    with open(tmp, "wb") as fh:  # a handle: np.save would append ".npy" to the name
        np.save(fh, uni)
    os.replace(tmp, out / "counts1.npy")
    result = {1: {"distinct": int(np.count_nonzero(uni)), "dtype": "uint64"}}
    for k in range(2, order + 1):
        tasks = range_tasks(runs, k, memory_bytes, num_proc, work, min_counts[k - 1], names)
        if progress:
            progress(f"merging order {k}: {len(tasks)} key ranges")
        if map_ranges is None:
            map_local(run_range, tasks, num_proc)
        else:
            map_ranges(tasks)
        parts = [t.part for t in tasks]
        fetched = out / f".parts-{os.getpid()}"  # in the staging dir: never left in a finished stats dir
        length, dtype = assemble(fetch_parts(parts, fetched) if fetch_parts else [Path(p) for p in parts], out, k)
        shutil.rmtree(fetched, ignore_errors=True)
        result[k] = {"distinct": length, "dtype": dtype}
    if fetch_parts is None:
        shutil.rmtree(work, ignore_errors=True)
    return result


def map_local(fn, tasks: list, num_proc: int) -> list:
    if num_proc <= 1 or len(tasks) <= 1:
        return [fn(t) for t in tasks]
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    # spawn, not fork: the parent may hold tokenizer threads or torch state
    with ProcessPoolExecutor(max_workers=min(num_proc, len(tasks), usable_cores()), mp_context=mp.get_context("spawn"),
                             initializer=die_with_parent, initargs=(os.getpid(),)) as pool:
        return list(pool.map(fn, tasks))
