"""The stats job: plan local shards, count them on N processes, merge, write the stats dir.

``--shard I/N`` restricts this machine to documents ``I mod N``; with ``--num-proc P`` that
range is split again into P sub-shards ``(I + N*p) mod N*P``. Partials of all machines are
merged later by ``multitoken stats merge``, which checks they tile the corpus exactly.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from multitoken.pipeline.base.atomic import atomic_dir, lock_file
from multitoken.pipeline.base.atomic import atomic_write_text
from multitoken.pipeline.base.config_io import save_resolved_config
from multitoken.pipeline.base.data import DataConfig, describe_files
from multitoken.pipeline.embedded import default_base, portable_base
from multitoken.pipeline.base.errors import CheckpointError, DataError, UsageError

from .format import FORMAT_VERSION, META_NAME, check_order, check_vocab
from .merge import merge_orders
from .shard import JOB_NAME, Job, check_runs, list_runs, read_job, shard_dir
from .workers import count_shards
from .table import _read_meta
from multitoken.pipeline.base.tokenizer import load_tokenizer, tokenizer_fingerprint

LOCK_NAME = ".lock"
MERGE_WORK = "merge-parts"
STATS_ARRAYS = (META_NAME, "counts[0-9].npy", "keys[0-9].npy")  # what a merge writes (and replaces)


@dataclass
class BuildConfig:
    out: str | None = field(default=None, metadata={"help": "stats directory to write"})
    tokenizer: str = field(default_factory=default_base, metadata={"help": "tokenizer (base model dir or Hub id) the corpus is tokenized with (default: the embedded model's)"})
    order: int = field(default=3, metadata={"help": "highest n-gram order counted (1-3)"})
    min_count: tuple[int, ...] = field(default=(1,), metadata={"help": "prune n-grams rarer than this at merge: one value for orders 2..N, or one per order 1..N"})
    num_proc: int = field(default=1, metadata={"help": "local worker processes"})
    shard: str | None = field(default=None, metadata={"help": "count only shard I/N of the corpus (merge the shards later with `multitoken stats merge`)", "metavar": "I/N"})
    memory_mb: int = field(default=1024, metadata={"help": "memory bound per process for count buffers; counts beyond it spill to disk"})
    vocab_size: int | None = field(default=None, metadata={"help": "vocabulary size (default: the tokenizer's length)"})
    keep_partials: bool = field(default=False, metadata={"help": "keep OUT/partials after merging (to merge again with other shards later)"})


def parse_shard(spec: str | None) -> tuple[int, int]:
    if spec is None:
        return 0, 1
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError as err:
        raise UsageError(f"--shard {spec!r} is not of the form I/N", "e.g. --shard 0/4 for the first of four shards") from err
    if not 0 <= i < n:
        raise UsageError(f"--shard {spec}: need 0 <= I < N", "shards are numbered from 0")
    return i, n


def min_counts_per_order(min_count: tuple[int, ...], order: int) -> list[int]:
    """One minimum per order 1..order (a single value applies to orders >= 2)."""
    values = list(min_count) if min_count else [1]
    if any(v < 1 for v in values):
        raise UsageError(f"--min-count values must be >= 1, got {values}")
    if len(values) == 1:
        return [1] + values * (order - 1)
    if len(values) != order:
        raise UsageError(f"--min-count takes 1 or {order} values for order {order}, got {len(values)}", f"e.g. --min-count 2 or --min-count {' '.join(['1'] + ['2'] * (order - 1))}")
    return values


def local_shards(shard: tuple[int, int], num_proc: int) -> list[tuple[int, int]]:
    i, n = shard
    return [(i + n * p, n * num_proc) for p in range(num_proc)]


def make_job(cfg: BuildConfig, data: DataConfig) -> Job:
    if not cfg.out:
        raise UsageError("no output directory given", "pass --out DIR")
    check_order(cfg.order)
    if cfg.num_proc < 1:
        raise UsageError(f"--num-proc must be >= 1, got {cfg.num_proc}")
    if cfg.memory_mb < 4:
        raise UsageError(f"--memory-mb {cfg.memory_mb} is too small", "pass at least 4 (MB)")
    if data.max_tokens is not None and data.max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {data.max_tokens}")
    tok = load_tokenizer(cfg.tokenizer)
    vocab = cfg.vocab_size or len(tok)
    check_vocab(vocab, cfg.order)
    return Job(data=data, tokenizer=cfg.tokenizer, fingerprint=tokenizer_fingerprint(tok), vocab_size=vocab,
               order=cfg.order, memory_bytes=cfg.memory_mb << 20, out=cfg.out)


@contextmanager
def job_lock(out: Path):
    """One lock over a whole job on ``out`` (counting, merge, clean-up): a second job on the
    same dir fails at once. ``out`` is created if missing and removed again if the job leaves it
    empty; the lock file goes with the lock."""
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        with lock_file(out / LOCK_NAME, f"the stats dir {out} (a stats build or merge)"):
            yield
    finally:
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()


def build(cfg: BuildConfig, data: DataConfig, log=print, overwrite: bool = False) -> Path | None:
    """Count (resuming if partials exist) and, unless ``--shard`` is given, merge. Returns the stats dir.

    ``overwrite``: a finished stats dir in ``--out`` is recounted (else a finished dir of the
    same job is left as it is, and one of another job is refused)."""
    if not cfg.out:
        raise UsageError("no output directory given", "pass --out DIR")
    out = Path(cfg.out)
    with job_lock(out):
        return _build_locked(cfg, data, out, log, overwrite)


def _build_locked(cfg: BuildConfig, data: DataConfig, out: Path, log, overwrite: bool) -> Path | None:
    job = make_job(cfg, data)
    files, lines = describe_files(data)  # also refuses a --split the data does not have
    print("\n".join(lines), file=sys.stderr, flush=True)
    mins = min_counts_per_order(cfg.min_count, cfg.order)
    shards = local_shards(parse_shard(cfg.shard), cfg.num_proc)
    if (out / META_NAME).exists():
        meta = _existing_meta(out, overwrite)
        if overwrite:
            log(f"{out}: --overwrite: recounting (the old stats stay until the new ones replace them)")
            (out / META_NAME).unlink()
            _remove_partials(out)
            shutil.rmtree(out / MERGE_WORK, ignore_errors=True)
        elif meta.get("job") != job.identity():
            raise UsageError(f"{out} already holds stats of another job", "pass --overwrite to recount it, or another --out")
        elif not _same_min_counts(meta, mins):
            _prepare_reprune(out, meta, mins, cfg.shard is not None)
            log(f"{out}: re-pruning the kept partial counts with min counts {mins}")
        else:
            log(f"{out} is complete already (pass --overwrite to recount)")
            if not cfg.keep_partials:  # a kill between writing meta.json and the clean-up
                _remove_partials(out, shards)
            return out
    _check_no_foreign_shards(out, shards)
    save_resolved_config(out / "config.json", "stats build", cfg, data, extra={"data_files": files})
    t0 = time.perf_counter()
    tokens = count_shards(job, shards, cfg.num_proc)
    log(f"counted {tokens:,} tokens in {time.perf_counter() - t0:.1f}s")
    if cfg.shard is not None:
        log(f"shard {cfg.shard} done; merge all shards with: multitoken stats merge DIR... --out STATS_DIR")
        return None
    write_stats(out, [shard_dir(out, s) for s in shards], mins, cfg.num_proc, job.memory_bytes, log, files=files)
    if not cfg.keep_partials:
        _remove_partials(out, shards)
    return out


def _existing_meta(out: Path, overwrite: bool) -> dict:
    """The meta.json already in ``--out`` (validated); damaged, it is refused unless overwriting."""
    try:
        return _read_meta(out)
    except CheckpointError as err:
        if overwrite:
            return {}
        raise UsageError(f"--out {out} holds a damaged stats dir: {err.problem}", "pass --overwrite to recount it, or another --out") from err


def _remove_partials(out: Path, shards: list[tuple[int, int]] | None = None) -> None:
    """Remove our shard dirs (those of ``shards``, or every ``shard-*`` holding a job.json) and
    ``partials/`` itself once empty: nothing else in it is touched."""
    root = out / "partials"
    if not root.is_dir():
        return
    dirs = [shard_dir(out, s) for s in shards] if shards is not None else \
        [d for d in root.glob("shard-*") if (d / JOB_NAME).is_file()]
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    if not any(root.iterdir()):
        root.rmdir()


def _same_min_counts(meta: dict, mins: list[int]) -> bool:
    return meta.get("min_counts") == {str(k + 1): m for k, m in enumerate(mins)}


def _prepare_reprune(out: Path, meta: dict, mins: list[int], sharded: bool) -> None:
    """A finished dir asked for other min counts: re-merge from its partials, or say why not.

    Pruning drops counts for good, so only the kept partials (``--keep-partials``) can give a
    lower or a different threshold. meta.json goes first: a kill mid re-merge must leave a dir
    that reads as unfinished (and reruns), never old meta over half-rewritten arrays.
    """
    was = ",".join(str(v) for _, v in sorted(meta.get("min_counts", {}).items(), key=lambda kv: int(kv[0])))
    if sharded or not (out / "partials").is_dir():
        raise UsageError(
            f"{out} is complete with --min-count {was}; re-pruning to {','.join(map(str, mins))} needs its partial "
            "counts, which were removed after the merge",
            f"rerun with --min-count {was} to reuse it, or delete {out} and rebuild with the new --min-count "
            "(add --keep-partials to be able to re-prune later)",
        )
    (out / META_NAME).unlink()


def _check_no_foreign_shards(out: Path, shards: list[tuple[int, int]]) -> None:
    planned = {shard_dir(out, s).name for s in shards}
    found = {p.name for p in (out / "partials").glob("shard-*")} if (out / "partials").exists() else set()
    if found - planned:
        raise UsageError(
            f"{out}/partials holds shards {sorted(found - planned)} from a run with other --num-proc/--shard values",
            "rerun with the original --num-proc and --shard (or delete the partials to start over)",
        )


def find_shard_dirs(inputs: list[str]) -> list[Path]:
    dirs = []
    for spec in inputs:
        p = Path(spec)
        if p.name.startswith("shard-") and (p / JOB_NAME).exists():
            dirs.append(p)
        elif (p / "partials").is_dir():
            dirs.extend(sorted(d for d in (p / "partials").glob("shard-*") if d.is_dir()))
        else:
            raise UsageError(f"{spec} holds no partial counts (no partials/ directory)", "pass directories written by `multitoken stats build --shard I/N`")
    if not dirs:
        raise UsageError("no shard partials found in " + ", ".join(inputs))
    return dirs


def check_coverage(shards: list[tuple[int, int]]) -> None:
    """The residue classes ``i mod n`` of the shards must tile the integers exactly once."""
    period = math.lcm(*(n for _, n in shards))
    if period > 10_000_000:
        raise UsageError(f"shard counts {sorted({n for _, n in shards})} are too irregular to check", "use the same N on every machine")
    cover = np.zeros(period, np.int64)
    for i, n in shards:
        cover[i::n] += 1
    if (cover == 0).any() or (cover > 1).any():
        missing = int((cover == 0).sum() * 100 / period)
        raise UsageError(
            f"the shards {sorted(shards)} do not cover the corpus exactly once ({missing}% of documents missing, {int((cover > 1).sum() * 100 / period)}% counted twice)",
            "pass the partials of every shard I/N, each once",
        )


def write_stats(out: Path, sdirs: list[Path], mins: list[int], num_proc: int, memory_bytes: int, log=print,
                files: list[str] | None = None) -> dict:
    """Merge the finished shards ``sdirs`` into the stats dir ``out`` and write its meta.json
    (staged, then published: the arrays of an older stats dir there are replaced, stale ones of
    other orders removed, files we did not write kept). ``files``: the local data files counted,
    when known; a merge of shards counted elsewhere records None, each shard's config.json lists
    its own."""
    jobs = [read_job(d) for d in sdirs]
    ident = {k: v for k, v in jobs[0].items() if k not in ("shard", "tokenizer")}
    for d, j in zip(sdirs, jobs):
        if {k: v for k, v in j.items() if k not in ("shard", "tokenizer")} != ident:
            raise UsageError(f"{d} belongs to another job than {sdirs[0]} (data, tokenizer or order differ)", "merge only shards of one job")
    order = ident["order"]
    if len(mins) != order:
        mins = min_counts_per_order(tuple(mins), order)
    check_coverage([tuple(j["shard"]) for j in jobs])
    runs, totals = [], [0] * order
    for d in sdirs:
        infos = check_runs(d, order)
        if not infos or not infos[-1]["done"]:
            raise CheckpointError(f"{d} is not finished counting", "rerun its `multitoken stats build` command to complete it")
        runs += list_runs(d)
        for info in infos:
            totals = [a + b for a, b in zip(totals, info["totals"])]
    if totals[0] == 0:
        raise DataError("the corpus produced no tokens", "check --data, --column and --max-tokens")
    short = [k + 1 for k, t in enumerate(totals) if t == 0]
    if short:
        raise DataError(f"the corpus holds no n-grams of order {short[0]} (every document is shorter than {short[0]} tokens)",
                        f"pass longer documents, or --order {short[0] - 1}")
    t0 = time.perf_counter()
    with atomic_dir(out, marker=META_NAME, owned=STATS_ARRAYS) as stage:
        kept = merge_orders(runs, stage, order, mins, ident["vocab_size"], memory_bytes, num_proc, log, work=out / MERGE_WORK)
        meta = _meta(jobs, ident, order, totals, kept, mins, files)
        atomic_write_text(stage / META_NAME, json.dumps(meta, indent=1) + "\n")  # published last: marks the dir complete
    shutil.rmtree(out / MERGE_WORK, ignore_errors=True)
    log(f"merged {len(runs)} runs in {time.perf_counter() - t0:.1f}s")
    return meta


def _meta(jobs: list[dict], ident: dict, order: int, totals: list[int], kept: dict, mins: list[int],
          files: list[str] | None) -> dict:
    from importlib.metadata import version

    meta = {
        "format_version": FORMAT_VERSION,
        "tokenizer": {"name": portable_base(str(jobs[0].get("tokenizer"))), "fingerprint": ident["tokenizer_fingerprint"]},
        "vocab_size": ident["vocab_size"],
        "orders": list(range(1, order + 1)),
        "total_tokens": totals[0],
        "ngram_totals": {str(k + 1): t for k, t in enumerate(totals)},
        "distinct": {str(k): v["distinct"] for k, v in kept.items()},
        "count_dtypes": {str(k): v["dtype"] for k, v in kept.items()},
        "min_counts": {str(k + 1): m for k, m in enumerate(mins)},
        "source": ident["data"],
        "shards": sorted(j["shard"] for j in jobs),
        "data_files": files,
        "package_version": version("multitoken"),
        "job": ident,
    }
    return meta


def merge(inputs: list[str], out: str, min_count: tuple[int, ...], num_proc: int, memory_mb: int, log=print) -> dict:
    sdirs = find_shard_dirs(inputs)
    mins = min_counts_per_order(min_count, read_job(sdirs[0])["order"])
    with job_lock(Path(out)):
        return write_stats(Path(out), sdirs, mins, num_proc, memory_mb << 20, log)

