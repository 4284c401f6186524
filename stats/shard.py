"""Map step: count one shard of the corpus into sorted runs spilled to disk, resumably.

A shard ``(i, n)`` is documents ``i, i+n, ...`` (``pipeline.data`` numbering) of the whole
corpus, or of a contiguous group of its files (``Shard.first..end``): then the task reads only
those files, and numbers their documents from 0. Counts are
held in memory until they reach the memory bound (or a checkpoint interval passes), then
merged and written as one run dir ``run-NNNNNN`` that also records where counting stopped:
``next = (doc index, tokens of that document consumed)``. Runs cover disjoint stretches of
the shard, so after a kill -9 a rerun counts from the last run's ``next`` and nothing is
counted twice; the final run carries ``done``.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from multitoken.base.atomic import lock_file
from multitoken.base.atomic import atomic_write_text
from multitoken.base.data import DataConfig, iter_documents
from multitoken.base.errors import CheckpointError, UsageError

from .counting import ChunkBuilder, count_chunk
from .format import MAX_ORDER, load_array, read_info, write_array_dir
from multitoken.base.tokenizer import load_tokenizer

BYTES_PER_CHUNK_TOKEN = 1000   # chunk buffers take ~150 B/token; a chunk gets ~15% of the bound
HELD_FRACTION = 0.3            # spilling concatenates held runs: peaks at ~2x their size


@dataclass
class Job:
    """Everything a worker needs to count a shard (picklable, for spawned processes)."""

    data: DataConfig
    tokenizer: str
    fingerprint: str
    vocab_size: int
    order: int
    memory_bytes: int
    out: str
    checkpoint_seconds: float = 600.0

    def identity(self) -> dict:
        """What must agree between a rerun and the partials it resumes (or merges with)."""
        return {"data": dataclasses.asdict(self.data), "tokenizer_fingerprint": self.fingerprint,
                "vocab_size": self.vocab_size, "order": self.order}

    @property
    def chunk_tokens(self) -> int:
        # at most 256k tokens (~40 MB of buffers): processes counting side by side then contend
        # far less for memory bandwidth than with larger chunks, and one process alone is no
        # slower (scripts/bench_stats.py measures the job)
        return int(min(max(self.memory_bytes // BYTES_PER_CHUNK_TOKEN, 1024), 1 << 18))

    @property
    def held_bytes(self) -> int:
        return int(self.memory_bytes * HELD_FRACTION)


class LazyTokenizer:
    """Loads the tokenizer on first use, so id-column corpora never import transformers."""

    def __init__(self, path: str):
        self.path = path
        self._tok = None

    def __call__(self, *args, **kwargs):
        if self._tok is None:
            self._tok = load_tokenizer(self.path)
        return self._tok(*args, **kwargs)


class Shard(NamedTuple):
    """What one map task counts: documents ``index mod count``, of the whole corpus (``files`` 0)
    or of files ``first..end-1`` of the corpus's ``files`` (numbered from 0 at ``first``). A plain
    ``(i, n)`` tuple is the whole-corpus shard."""

    index: int
    count: int
    first: int = 0
    end: int = 0
    files: int = 0

    @property
    def file_group(self) -> tuple[int, int, int] | None:
        return (self.first, self.end, self.files) if self.files else None

    def record(self) -> dict:
        """The shard's fields in job.json (no ``files`` key for a whole-corpus shard, as before)."""
        return {"shard": [self.index, self.count], **({"files": list(self.file_group)} if self.files else {})}


def shard_dir(out: str | Path, shard: tuple[int, ...]) -> Path:
    s = Shard(*shard)
    files = f"-files-{s.first:05d}-{s.end:05d}-of-{s.files:05d}" if s.files else ""
    return Path(out) / "partials" / f"shard-{s.index:05d}-of-{s.count:05d}{files}"


def shard_budget(max_tokens: int | None, shard: tuple[int, ...]) -> int | None:
    """This shard's share of a global token budget (split evenly, remainder to the first)."""
    if max_tokens is None:
        return None
    i, n = shard[:2]
    return max_tokens // n + (1 if i < max_tokens % n else 0)


def list_runs(sdir: Path) -> list[Path]:
    """Finished run dirs of a shard, in order; leftovers of killed writes are removed."""
    for tmp in sdir.glob(".run-*.tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)
    return sorted(p for p in sdir.glob("run-*") if p.is_dir())


def run_arrays(order: int) -> list[str]:
    """o1: dense unigram counts; per order k: kk keys and ck counts of sorted sub-runs starting at sk."""
    return ["o1"] + [f"{x}{k}" for k in range(2, order + 1) for x in ("k", "c", "s")]


def check_runs(sdir: Path, order: int) -> list[dict]:
    """Infos of all runs of a shard, every array opened and length-checked."""
    infos = []
    for run in list_runs(sdir):
        info = read_info(run)
        for name in run_arrays(order):
            if name not in info["arrays"]:
                raise CheckpointError(f"{run}: no array {name!r} (partial of another order?)", f"delete {sdir} and rerun")
            load_array(run, name, info)
        infos.append(info)
    return infos


@contextmanager
def shard_lock(sdir: Path):
    """Exclusive lock on a shard dir; released by the OS even on kill -9, its file removed on exit."""
    sdir.mkdir(parents=True, exist_ok=True)
    with lock_file(sdir / ".lock", f"the partial counts {sdir}"):
        yield


JOB_NAME = "job.json"


def read_job(sdir: Path) -> dict:
    """A shard's ``job.json``, validated: what it counts and which shard it is."""
    path = Path(sdir) / JOB_NAME
    fix = f"delete {sdir} and rerun its `multitoken stats build` command to recount that shard"
    try:
        job = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: missing or not valid JSON ({err})", fix) from err

    def count(v, lo: int = 0) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= lo

    shard = job.get("shard") if isinstance(job, dict) else None
    files = job.get("files", [0, 1, 1]) if isinstance(job, dict) else None
    checks = (isinstance(job, dict) and isinstance(job.get("data"), dict)
              and isinstance(job.get("tokenizer_fingerprint"), str) and count(job.get("vocab_size"), 1)
              and count(job.get("order"), 1) and job["order"] <= MAX_ORDER
              and isinstance(shard, list) and len(shard) == 2 and all(count(x) for x in shard) and shard[0] < shard[1]
              and isinstance(files, list) and len(files) == 3 and all(count(x) for x in files)
              and files[0] < files[1] <= files[2])
    if not checks:
        raise CheckpointError(f"{path}: not a shard record (needs data, tokenizer_fingerprint, vocab_size >= 1, "
                              f"order 1..{MAX_ORDER}, shard [I, N] with 0 <= I < N and, if given, files "
                              "[FIRST, END, TOTAL] with FIRST < END <= TOTAL)", fix)
    return job


def check_identity(sdir: Path, job: Job, shard: Shard) -> None:
    want = {**job.identity(), **shard.record()}
    path = sdir / JOB_NAME
    if path.exists():
        have = read_job(sdir)
        have.pop("tokenizer", None)  # a path, may differ between machines; the fingerprint decides
        if have != want:
            raise UsageError(
                f"{sdir} holds partial counts of a different job ({_diff(have, want)})",
                "rerun with the original options, or use another --out (or delete that directory)",
            )
        return
    atomic_write_text(path, json.dumps({**want, "tokenizer": job.tokenizer}, indent=1) + "\n")


def _diff(have: dict, want: dict) -> str:
    keys = [k for k in want if have.get(k) != want[k]]
    return ", ".join(f"{k}: {have.get(k)!r} there, {want[k]!r} now" for k in keys)


class _Held:
    """Counts held in memory since the last spill."""

    def __init__(self, order: int, vocab_size: int):
        self.unigrams = np.zeros(vocab_size, np.uint64)
        self.runs: dict[int, list] = {k: [] for k in range(2, order + 1)}
        self.totals = [0] * order
        self.nbytes = 0
        self.since = time.monotonic()

    def add(self, chunk) -> None:
        self.unigrams += chunk.unigrams
        for k, (keys, counts) in chunk.runs.items():
            self.runs[k].append((keys, counts))
            self.nbytes += keys.nbytes + counts.nbytes
        self.totals = [a + b for a, b in zip(self.totals, chunk.totals)]


def count_shard(job: Job, shard: tuple[int, ...], progress: Callable[[int], None] | None = None,
                documents: Callable[[DataConfig, int], Iterable[tuple[int, np.ndarray]]] | None = None) -> dict:
    """Count ``shard`` (a ``Shard``, or ``(i, n)``) into ``job.out/partials``; resume if runs exist.
    Returns the last run's info.

    ``documents(data, start)`` replaces the corpus reader (benchmarks feed in-memory token arrays).
    """
    shard = Shard(*shard)
    sdir = shard_dir(job.out, shard)
    with shard_lock(sdir):
        check_identity(sdir, job, shard)
        infos = check_runs(sdir, job.order)
        if infos and infos[-1]["done"]:
            return infos[-1]
        tokens = infos[-1]["tokens"] if infos else 0
        doc, offset = infos[-1]["next"] if infos else (0, 0)
        if progress and tokens:
            progress(tokens)
        budget = shard_budget(job.data.max_tokens, shard)
        # iter_documents re-yields the first `offset` tokens of the resumed document
        data = dataclasses.replace(job.data, max_tokens=None if budget is None else budget - tokens + offset)
        state = {"sdir": sdir, "run": len(infos), "tokens": tokens, "next": [doc, offset], "count_s": 0.0, "spill_s": 0.0}
        held = _Held(job.order, job.vocab_size)
        builder = ChunkBuilder(job.order, job.chunk_tokens)
        if budget is None or tokens < budget:
            docs = documents(data, doc) if documents else iter_documents(
                data, LazyTokenizer(job.tokenizer), vocab_size=job.vocab_size, shard=shard[:2], start=doc,
                files=shard.file_group)
            for index, ids in docs:
                for chunk in builder.add(index, ids, offset if index == doc else 0):
                    _count(job, chunk, builder.position, held, state, progress)
        _count(job, builder.take(), builder.position, held, state, progress)
        info = _spill(job, held, state, done=True)
        # CPU seconds spent counting chunks vs merging and writing runs (for benchmarks)
        return {**info, "cpu_seconds": {"count": state["count_s"], "spill": state["spill_s"]}}


def _count(job: Job, chunk, position, held: _Held, state: dict, progress) -> None:
    if chunk is not None:
        t0 = time.process_time()
        counted = count_chunk(*chunk, job.order, job.vocab_size)
        held.add(counted)
        state["count_s"] += time.process_time() - t0
        state["tokens"] += counted.totals[0]
        if progress:
            progress(counted.totals[0])
    if position is not None:
        state["next"] = list(position)
    if held.nbytes > job.held_bytes or time.monotonic() - held.since > job.checkpoint_seconds:
        _spill(job, held, state, done=False)
        held.__init__(job.order, job.vocab_size)


def _spill(job: Job, held: _Held, state: dict, done: bool) -> dict:
    """Write held counts as the next run dir (atomic); the resume point goes with them.

    The chunks' sorted runs are written back to back, unmerged (``sN`` holds where each
    starts): merging is the reduce step's job, done there once per key range in parallel.
    Chunk counts fit in uint32 (a chunk holds < 2^32 tokens), a quarter less to write.
    """
    t0 = time.process_time()
    arrays = {"o1": held.unigrams}
    for k, runs in held.runs.items():
        sizes = [keys.size for keys, _ in runs]
        arrays[f"s{k}"] = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)
        # lists of pieces: write_array_dir streams them into one array file without a concatenated copy
        arrays[f"k{k}"] = [np.zeros(0, np.uint64)] + [keys for keys, _ in runs]
        arrays[f"c{k}"] = [np.zeros(0, np.uint32)] + [c.astype(np.uint32) for _, c in runs]
        runs.clear()
    info = {"next": state["next"], "tokens": state["tokens"], "totals": held.totals, "done": done}
    write_array_dir(state["sdir"] / f"run-{state['run']:06d}", arrays, info)
    state["run"] += 1
    state["spill_s"] += time.process_time() - t0
    return info
